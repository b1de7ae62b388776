"""SLO benchmark of scale-triggered recovery (ElasticMoE §7.5, Fig. 9) and of SLO vs load (§7.6, Fig. 10).

    python -m coordinator.bench.autoscale --json --plot autoscale.png

One in-process elastic server (small model by default, 2 devices, dp 1, autoscaler
off: the commands are issued at fixed times, as in the paper). Per strategy
(`elastic`, `cold_restart`, `concurrent`):

- calibration: the workload's capacity at dp 1 and dp 2 (closed-loop bursts), so the
  load levels below mean the same on any machine;
- scale-up (Fig. 9a): dp 1 serves a low load; at t=0 it steps to a rate dp 1 cannot
  sustain but dp 2 can (0.8 x the dp-2 capacity); the scale command
  (dp 1 -> 2) is issued `--command-delay-s` later; SLO attainment per time bin;
- scale-down (Fig. 9b): dp 2 serves that rate; at t=0 it drops to a low one and
  dp 2 -> 1 is issued `--command-delay-s` later; attainment and attainment per device
  (the devices held, averaged over time: the paper's SLO/NPU);
- SLO vs rps (Fig. 10): for each level (a multiple of the dp-1 capacity), dp 1 under
  that Poisson rate with dp 1 -> 2 issued at `--command-at-s`; the run's attainment.

Timings on a shared 2-core machine are noisy: every figure comes from the same
server and workload, so compare strategies within one run.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import secrets
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx

from coordinator.bench.arrivals import Constant, Poisson, Ramp, RateSchedule
from coordinator.bench.load_report import events_on_axis, slo_attainment_over_time, summarize
from coordinator.bench.load_runner import LoadSpec, plan_requests, run_load
from coordinator.bench.report_output import claim_stdout, emit, progress_printer
from coordinator.bench.request_shapes import AdapterMix, LengthDist, parse_length
from coordinator.bench.server_admin import (
    PRESETS,
    ensure_dp,
    resolve_model,
    wait_event,
    wait_standby,
)
from elasticmoe.utils.ports import free_port

STRATEGIES = ("elastic", "cold_restart", "concurrent")
_GIB = 1 << 30


_progress = progress_printer("autoscale")


class Bench:
    """The server's client and the fixed workload shape of every run."""

    def __init__(self, url: str, model: str, args: argparse.Namespace, vocab_size: int) -> None:
        self.url, self.model, self.args, self.vocab_size = url, model, args, vocab_size
        self.client = httpx.AsyncClient(base_url=url, timeout=120)

    def spec(self, schedule: RateSchedule, duration_s: float, seed: int) -> LoadSpec:
        return LoadSpec(schedule, duration_s, AdapterMix.single(self.model), self.args.prompt_len,
                        self.args.output_len, vocab_size=self.vocab_size, seed=seed)

    async def settle(self, dp: int) -> None:
        """At `dp`, no scale running, standby pool ready: every run starts alike."""
        await ensure_dp(self.client, dp, self.args.event_timeout_s, _progress)
        await wait_standby(self.client, self.args.event_timeout_s, _progress)

    # ---- calibration ---------------------------------------------------------------------

    async def capacity(self, dp: int, n: int) -> float:
        """Requests/s of `n` concurrent requests of the workload at `dp` (closed loop)."""
        await self.settle(dp)
        # The workload's shapes (n of them, plus 4 to warm up), sent all at once.
        planned = plan_requests(self.spec(Constant(float(n + 4)), 1.0, seed=99))
        warm_up: list[dict[str, Any]] = []
        bodies: list[dict[str, Any]] = []
        for p in planned:
            body = {k: v for k, v in p.body().items() if k not in ("stream", "stream_options")}
            (warm_up if len(warm_up) < 4 else bodies).append(body)
        await asyncio.gather(*[self.client.post("/v1/completions", json=b) for b in warm_up])
        t0 = time.perf_counter()
        responses = await asyncio.gather(*[self.client.post("/v1/completions", json=b) for b in bodies])
        elapsed = time.perf_counter() - t0
        bad = [r for r in responses if r.status_code != 200]
        if bad:
            raise RuntimeError(f"{len(bad)} calibration requests failed, e.g. HTTP {bad[0].status_code}: "
                               f"{bad[0].text[:300]}")
        return len(bodies) / elapsed

    # ---- one run ---------------------------------------------------------------------------

    async def run(self, strategy: str, from_dp: int, to_dp: int, schedule: RateSchedule, duration_s: float,
                  command_at_s: float, seed: int) -> dict[str, Any]:
        """Load from t=0, the scale command at `command_at_s`; the run's records, event and figures."""
        await self.settle(from_dp)
        args = self.args

        async def command() -> dict[str, Any]:
            await asyncio.sleep(command_at_s)
            posted = time.time()
            r = await self.client.post("/admin/scale", json={"dp": to_dp, "strategy": strategy})
            if r.status_code != 202:
                return {"error": f"HTTP {r.status_code}: {r.text[:200]}", "posted_at": posted}
            event = await wait_event(self.client, r.json()["event_id"], args.event_timeout_s)
            return {**event, "posted_at": posted}

        task = asyncio.create_task(command())
        result = await run_load(self.spec(schedule, duration_s, seed), self.url, request_timeout_s=300)
        event = await task
        records = result.records
        bins = slo_attainment_over_time(records, args.bin_s, args.slo_ttft_s, args.slo_tpot_s, end_s=duration_s)
        (on_axis,) = events_on_axis([{**event, "started_at": event.get("started_at") or event["posted_at"]}],
                                    result.t0_wall)
        summary = summarize(records, duration_s, args.slo_ttft_s, args.slo_tpot_s)
        return {
            "strategy": strategy, "from_dp": from_dp, "to_dp": to_dp, "schedule": schedule.to_dict(),
            "duration_s": duration_s, "command_at_s": command_at_s,
            "event": {k: on_axis.get(k) for k in ("state", "start_s", "end_s", "scale_latency_s", "downtime_s",
                                                   "peak_memory_bytes", "error")},
            "attainment": summary["slo"]["attainment"],
            "attainment_after_command": _attainment(bins, command_at_s),
            "device_seconds": _device_seconds(from_dp, to_dp, on_axis, duration_s),
            "num_requests": summary["num_requests"], "num_failed": summary["num_failed"], "errors": summary["errors"],
            "ttft_s_p50": summary["ttft_s"]["p50"], "ttft_s_p99": summary["ttft_s"]["p99"],
            "bins": [{"start_s": b.start_s, "attainment": b.attainment, "num_requests": b.num_requests} for b in bins],
        }


def _attainment(bins: Sequence[Any], from_s: float) -> float | None:
    """Attainment of the requests arriving at or after `from_s`."""
    n = sum(b.num_requests for b in bins if b.start_s >= from_s)
    return sum(b.num_attained for b in bins if b.start_s >= from_s) / n if n else None


def _device_seconds(from_dp: int, to_dp: int, event: dict[str, Any], duration_s: float) -> float:
    """Devices held over [0, duration_s): from_dp until the event ends, then to_dp (concurrent and
    extravagant would hold both while the copy loads; counted as the larger, the kinder view)."""
    end = event.get("end_s")
    switch = duration_s if end is None else min(max(end, 0.0), duration_s)
    return from_dp * switch + to_dp * (duration_s - switch)


# ---- the experiments -------------------------------------------------------------------------


async def experiments(bench: Bench, strategies: Sequence[str]) -> dict[str, Any]:
    args = bench.args
    _progress("calibrating: capacity of the workload at dp 1 and dp 2")
    cap = {dp: await bench.capacity(dp, args.calibration_requests) for dp in (1, 2)}
    _progress(f"capacity: dp 1 {cap[1]:.2f} req/s, dp 2 {cap[2]:.2f} req/s ({cap[2] / cap[1]:.2f}x)")
    low = args.low_rps or 0.4 * cap[1]
    # NOTE: at least twice the low load: where dp 2 adds little (two ranks sharing few cores, or a
    # noisy calibration), 0.8 x its capacity may fall below 0.4 x dp 1's, and "up" would be down.
    high = args.high_rps or max(0.8 * cap[2], 2 * low)
    if cap[2] <= cap[1]:
        _progress("warning: dp 2 measured no more capacity than dp 1 here (the ranks share the cores); "
                  f"the high load is {high:.2f} rps, 2 x the low one")
    pre, delay, duration = args.pre_s, args.command_delay_s, args.run_s
    up_load = Ramp(((0.0, low), (pre - 0.01, low), (pre, high), (pre + duration, high)))
    down_load = Ramp(((0.0, high), (pre - 0.01, high), (pre, low), (pre + duration, low)))
    doc: dict[str, Any] = {"capacity_rps": {"dp1": cap[1], "dp2": cap[2]}, "low_rps": low, "high_rps": high,
                           "scale_up": [], "scale_down": [], "slo_vs_rps": []}
    for s in strategies:
        _progress(f"scale-up run: {s}, {low:.1f} -> {high:.1f} rps at t={pre:g}s, dp 1 -> 2 at t={pre + delay:g}s")
        doc["scale_up"].append(await bench.run(s, 1, 2, up_load, pre + duration, pre + delay, seed=1))
        _log(doc["scale_up"][-1])
        _progress(f"scale-down run: {s}, {high:.1f} -> {low:.1f} rps at t={pre:g}s, dp 2 -> 1 at t={pre + delay:g}s")
        doc["scale_down"].append(await bench.run(s, 2, 1, down_load, pre + duration, pre + delay, seed=2))
        _log(doc["scale_down"][-1])
    for level in args.levels:
        rps = level * cap[1]
        for s in strategies:
            _progress(f"SLO vs rps: {s} at {rps:.2f} rps ({level:g} x dp-1 capacity), dp 1 -> 2 at "
                      f"t={args.command_at_s:g}s")
            run = await bench.run(s, 1, 2, Poisson(rps), args.level_s, args.command_at_s, seed=3)
            run.pop("bins")
            doc["slo_vs_rps"].append({"level": level, "rps": rps, **run})
            _log(run)
    return doc


def _log(run: dict[str, Any]) -> None:
    e = run["event"]
    _progress(f"  {run['strategy']}: attainment {_pct(run['attainment'])} (after the command "
              f"{_pct(run['attainment_after_command'])}), scale {e['state']} in {_num(e['scale_latency_s'])} s, "
              f"failed {run['num_failed']}/{run['num_requests']}" + (f" {run['errors']}" if run["errors"] else ""))


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.0f}%"


def _num(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"


def format_tables(doc: dict[str, Any]) -> str:
    lines = [f"capacity: dp 1 {doc['capacity_rps']['dp1']:.2f} req/s, dp 2 {doc['capacity_rps']['dp2']:.2f} req/s",
             "", "| run | strategy | scale latency s | SLO after command | SLO overall | SLO / device | failed |",
             "|---|---|---|---|---|---|---|"]
    for kind in ("scale_up", "scale_down"):
        for r in doc[kind]:
            per_device = None if r["attainment"] is None else r["attainment"] * r["duration_s"] / r["device_seconds"]
            lines.append(f"| {kind.replace('_', '-')} dp {r['from_dp']}->{r['to_dp']} | {r['strategy']} | "
                         f"{_num(r['event']['scale_latency_s'])} | {_pct(r['attainment_after_command'])} | "
                         f"{_pct(r['attainment'])} | {_num(per_device)} | {r['num_failed']}/{r['num_requests']} |")
    strategies = list(dict.fromkeys(r["strategy"] for r in doc["slo_vs_rps"]))
    lines += ["", "| rps (x dp-1 capacity) | " + " | ".join(strategies) + " |", "|---" * (len(strategies) + 1) + "|"]
    for level in dict.fromkeys(r["level"] for r in doc["slo_vs_rps"]):
        row = {r["strategy"]: r for r in doc["slo_vs_rps"] if r["level"] == level}
        rps = next(iter(row.values()))["rps"]
        lines.append(f"| {rps:.2f} ({level:g}x) | " + " | ".join(_pct(row[s]["attainment"]) for s in strategies) + " |")
    return "\n".join(lines)


def plot(doc: dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    for ax, kind, title in ((axes[0], "scale_up", "(a) scale-up dp 1 -> 2"),
                            (axes[1], "scale_down", "(b) scale-down dp 2 -> 1")):
        for i, r in enumerate(doc[kind]):
            pts = [(b["start_s"] - r["command_at_s"], 100 * b["attainment"]) for b in r["bins"]
                   if b["attainment"] is not None]
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker=".", color=f"C{i}", label=r["strategy"])
            end = r["event"]["end_s"]
            if end is not None:
                ax.axvline(end - r["command_at_s"], color=f"C{i}", linewidth=0.8, linestyle=":")
        ax.axvline(0, color="black", linestyle="--", linewidth=1)
        ax.axhline(90, color="grey", linewidth=0.8)
        ax.set(title=title, xlabel="s since the scale command (dotted: scale done)", ylabel="SLO attained %",
               ylim=(-5, 105))
        ax.legend(fontsize=8)
    ax = axes[2]
    strategies = list(dict.fromkeys(r["strategy"] for r in doc["slo_vs_rps"]))
    for i, s in enumerate(strategies):
        rows = [r for r in doc["slo_vs_rps"] if r["strategy"] == s]
        ax.plot([r["rps"] for r in rows], [100 * (r["attainment"] or 0) for r in rows], marker="o", color=f"C{i}",
                label=s)
    ax.axhline(90, color="grey", linewidth=0.8)
    ax.set(title="(c) SLO attainment vs load, dp 1 -> 2 issued early", xlabel="requests/s",
           ylabel="SLO attained %", ylim=(-5, 105))
    ax.legend(fontsize=8)
    cfg = doc["config"]
    fig.suptitle(f"{Path(cfg['model']).name}: SLO TTFT <= {cfg['slo_ttft_s']:g} s, TPOT <= {cfg['slo_tpot_s']:g} s; "
                 f"capacity dp1 {doc['capacity_rps']['dp1']:.1f}, dp2 {doc['capacity_rps']['dp2']:.1f} req/s",
                 fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ---- main --------------------------------------------------------------------------------------


def _levels(text: str) -> list[float]:
    try:
        levels = [float(x) for x in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"want comma-separated numbers, got {text!r}") from None
    if not levels or any(not x > 0 for x in levels):
        raise argparse.ArgumentTypeError(f"levels must be > 0, got {text!r}")
    return levels


def _length(text: str) -> LengthDist:
    try:
        return parse_length(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m coordinator.bench.autoscale",
        description="SLO attainment around scale-up and scale-down commands (ElasticMoE Fig. 9) and across "
        "increasing load (Fig. 10), for ElasticMoE vs the cold-restart and concurrent baselines.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--strategies", default=",".join(STRATEGIES), help="comma-separated scale strategies")
    p.add_argument("--preset", default="small", choices=sorted(PRESETS), help="model when --model is not given")
    p.add_argument("--model", default=None, metavar="DIR", help="model directory (overrides --preset's)")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--prompt-len", type=_length, default=parse_length("uniform:256:512"),
                   help="prompt tokens: N, uniform:LO:HI, normal:MEAN:STD, lognormal:MEDIAN:SIGMA. Prefill-heavy "
                   "by default: on CPU, ranks add prefill capacity (decode steps are bound by the per-step "
                   "expert all-to-all)")
    p.add_argument("--output-len", type=_length, default=parse_length("8"), help="output tokens (ignore_eos)")
    p.add_argument("--slo-ttft-s", type=float, default=1.0, help="TTFT bound (paper §7.6: 1 s)")
    p.add_argument("--slo-tpot-s", type=float, default=1.0, help="TPOT bound (paper §7.6: 1 s)")
    p.add_argument("--calibration-requests", type=int, default=32, help="requests per capacity burst")
    p.add_argument("--low-rps", type=float, default=None, help="the low rate (default 0.4 x dp-1 capacity)")
    p.add_argument("--high-rps", type=float, default=None,
                   help="the high rate (default 0.8 x the dp-2 capacity: Poisson arrivals queue well below "
                   "the closed-loop capacity; at least 2 x the low rate)")
    p.add_argument("--standby-delay-s", type=float, default=15.0,
                   help="the server's --standby-delay: no standby boot competes for the cores in the first S s "
                   "after a scale (on accelerators it would not)")
    p.add_argument("--pre-s", type=float, default=6.0, help="seconds before the load step (t=0 of Fig. 9)")
    p.add_argument("--command-delay-s", type=float, default=2.0, help="scale command this long after the step")
    p.add_argument("--run-s", type=float, default=30.0, help="seconds of load after the step")
    p.add_argument("--levels", type=_levels, default=_levels("0.6,1.0,1.4"),
                   help="Fig. 10 load levels as multiples of the dp-1 capacity")
    p.add_argument("--level-s", type=float, default=25.0, help="seconds of load per level")
    p.add_argument("--command-at-s", type=float, default=4.0, help="Fig. 10: scale command at this time")
    p.add_argument("--bin-s", type=float, default=2.0, help="SLO attainment time bins, seconds")
    p.add_argument("--event-timeout-s", type=float, default=600.0, help="give up waiting for a scale after this")
    p.add_argument("--json", action="store_true", help="print the results as one JSON document on stdout")
    p.add_argument("--out", default=None, metavar="FILE", help="also write the JSON document to FILE")
    p.add_argument("--plot", default=None, metavar="FILE", help="write the three-panel PNG to FILE")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    strategies = [s.strip() for s in args.strategies.split(",") if s.strip()]
    from coordinator.strategies import STRATEGIES as KNOWN

    unknown = [s for s in strategies if s not in KNOWN or KNOWN[s].placement == "fresh_devices"]
    if unknown or not strategies:
        print(f"error: --strategies: unknown or needing extra devices: {unknown}", file=sys.stderr)
        return 2
    model_dir = resolve_model(args, _progress)
    vocab_size = int(json.loads((Path(model_dir) / "config.json").read_text())["vocab_size"])

    from coordinator.autoscaler import AutoscaleConfig
    from coordinator.config import CoordinatorConfig
    from coordinator.launch import start_elastic

    json_out = claim_stdout()
    preset = PRESETS[args.preset]
    config = CoordinatorConfig(
        model_dir=model_dir, num_devices=2, dp=1, dtype=args.dtype, device_memory_bytes=int(preset[1] * _GIB),
        kv_bytes_per_device=int(preset[2] * _GIB), max_queued=1024, shm_prefix=f"emoeauto{secrets.token_hex(4)}",
        autoscale=AutoscaleConfig(enabled=False, slo_ttft_s=args.slo_ttft_s, slo_tpot_s=args.slo_tpot_s),
        standby_delay_s=args.standby_delay_s,
    )
    _progress(f"starting the elastic server: {model_dir}, 2 devices, dp 1, {args.dtype}")
    server = start_elastic(config, port=free_port(), ray_init_kwargs={"num_cpus": 2, "log_to_driver": False})

    async def go() -> dict[str, Any]:
        async with httpx.AsyncClient(base_url=server.url) as c:
            model = (await c.get("/v1/models")).json()["data"][0]["id"]
        bench = Bench(server.url, model, args, vocab_size)
        try:
            return await experiments(bench, strategies)
        finally:
            await bench.client.aclose()

    try:
        results = asyncio.run(go())
    finally:
        _progress("shutting the server down")
        server.shutdown()
    doc = {
        "benchmark": "coordinator.bench.autoscale",
        "config": {"model": model_dir, "dtype": args.dtype, "strategies": strategies,
                   "prompt_len": args.prompt_len.spec(), "output_len": args.output_len.spec(),
                   "slo_ttft_s": args.slo_ttft_s, "slo_tpot_s": args.slo_tpot_s, "pre_s": args.pre_s,
                   "command_delay_s": args.command_delay_s, "run_s": args.run_s, "levels": args.levels,
                   "level_s": args.level_s, "command_at_s": args.command_at_s, "bin_s": args.bin_s,
                   "standby_delay_s": args.standby_delay_s},
        **results,
    }
    emit(doc, format_tables(doc), json_out, as_json=args.json, out_path=args.out, plot_path=args.plot,
         plot=plot, progress=_progress)
    return 0


if __name__ == "__main__":
    sys.exit(main())
