"""Load generator CLI: drive a server with a chosen arrival pattern and report latencies and SLOs.

    python -m coordinator.bench.load --url http://127.0.0.1:8000 --pattern poisson --rps 4 \\
        --duration 60 --prompt-len uniform:16:64 --output-len normal:64:16 --json out.json --plot out.png

Works against `elasticmoe serve --single` and the elastic server (streamed `/v1/completions`).
Writes a JSON report (config, one row per request, summary, timeline, scale events) and two
PNGs (`out.png`: SLO attainment and rps over time; `out-cdf.png`: TTFT / TPOT CDFs). The
schedule and the requests depend only on --seed. Exit status: 0 once the run completes
(failed requests are in the report), 2 for bad arguments. The library is
`coordinator.bench.load_runner` (run_load) and `coordinator.bench.load_report` (figures).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, TextIO

import httpx

from coordinator.bench.arrivals import (
    Bursty,
    Constant,
    Patterned,
    Poisson,
    Ramp,
    RateSchedule,
    parse_rate_csv,
)
from coordinator.bench.load_report import record_to_dict, summarize, timeline
from coordinator.bench.load_runner import LoadProgress, LoadSpec, install_stop_on_sigint, run_load
from coordinator.bench.loadgen import LoadResult
from coordinator.bench.request_shapes import AdapterMix, parse_length, parse_names, parse_weights

PATTERNS = ("constant", "poisson", "bursty", "ramp", "csv")
DEFAULT_DURATION_S = 60.0
EPILOG = """\
length SPECs (integers; normal/lognormal are rounded and clipped to [LO, HI], default [1, unbounded]):
  N | fixed:N | uniform:LO:HI | normal:MEAN:STD[:LO:HI] | lognormal:MEDIAN:SIGMA[:LO:HI] (SIGMA: std of ln)

examples:
  %(prog)s --url http://127.0.0.1:8000 --pattern poisson --rps 4 --duration 60 --json out.json --plot out.png
  %(prog)s --pattern bursty --rps-on 8 --rps-off 0 --on-s 10 --off-s 20 --duration 120
  %(prog)s --pattern ramp --ramp-points 0:1,60:10,120:1 --duration 120 --slo-ttft 2 --slo-tpot 0.2
  %(prog)s --pattern csv --csv trace.csv --adapters base,math,code --adapter-alpha 1.2
"""


def _arg_type(parse: Callable[[str], Any]) -> Callable[[str], Any]:
    """argparse type from a parser raising ValueError (argparse then names the option and exits 2)."""

    def convert(text: str) -> Any:
        try:
            return parse(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    convert.__name__ = parse.__name__
    return convert


def _number(lo: float, strict: bool) -> Callable[[str], float]:
    def parse(text: str) -> float:
        x = float(text)
        if not (x > lo if strict else x >= lo) or x == float("inf"):
            raise ValueError(f"want a number {'>' if strict else '>='} {lo:g}, got {text!r}")
        return x

    return _arg_type(parse)


def _vocab_size(text: str) -> int:
    n = int(text)
    if n <= 5:
        raise ValueError(f"want an integer > 5 (ids below 5 are skipped), got {text!r}")
    return n


def _ramp_points(text: str) -> tuple[tuple[float, float], ...]:
    try:
        return tuple((float(t), float(r)) for t, r in (p.split(":") for p in text.split(",")))
    except ValueError:
        raise ValueError(f"want T:RPS[,T:RPS...], e.g. 0:1,30:10,60:2, got {text!r}") from None


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m coordinator.bench.load",
        description="Send streamed completions at a seeded arrival pattern; report TTFT, TPOT,\n"
        "throughput and SLO attainment (JSON, PNG plots).",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=EPILOG,
    )
    g = p.add_argument_group("server")
    g.add_argument("--url", default="http://127.0.0.1:8000", help="server base URL (default: %(default)s)")
    g.add_argument("--model", default=None, help="model name (default: the first of GET /v1/models)")
    g.add_argument("--api-key", default=os.environ.get("ELASTICMOE_API_KEY"), metavar="KEY",
                   help="sent as 'Authorization: Bearer KEY' (default: $ELASTICMOE_API_KEY)")
    g.add_argument("--admin-key", default=os.environ.get("ELASTICMOE_ADMIN_KEY"), metavar="KEY",
                   help="key for GET /admin/status (scale events) if the server has a separate admin key "
                   "(default: $ELASTICMOE_ADMIN_KEY, else --api-key)")
    g.add_argument("--timeout", type=_number(0, True), default=300.0, metavar="S",
                   help="per-request timeout; also how long requests may run after the last arrival (default: %(default)s)")
    g = p.add_argument_group("arrivals (Poisson-modulated by rps(t), except constant)")
    g.add_argument("--pattern", choices=PATTERNS, default="poisson",
                   help="constant: every 1/RPS s; poisson: rate RPS; bursty: on/off; ramp: linear or "
                   "piecewise-linear rps(t); csv: rps per second from a file (default: %(default)s)")
    g.add_argument("--duration", type=_number(0, True), default=None, metavar="S",
                   help=f"seconds of arrivals (default {DEFAULT_DURATION_S:g}; csv: one second per row)")
    g.add_argument("--rps", type=_number(0, False), metavar="RPS", default=1.0, help="constant, poisson: requests/s (default: %(default)s)")
    g.add_argument("--rps-on", type=_number(0, False), default=None, metavar="RPS", help="bursty: requests/s while on")
    g.add_argument("--rps-off", type=_number(0, False), metavar="RPS", default=0.0, help="bursty: requests/s while off (default: %(default)s)")
    g.add_argument("--on-s", type=_number(0, True), metavar="S", default=5.0, help="bursty: seconds on; the run starts on (default: %(default)s)")
    g.add_argument("--off-s", type=_number(0, False), metavar="S", default=5.0, help="bursty: seconds off (default: %(default)s)")
    g.add_argument("--ramp-from", type=_number(0, False), metavar="RPS", default=0.0, help="ramp: requests/s at t=0 (default: %(default)s)")
    g.add_argument("--ramp-to", type=_number(0, False), metavar="RPS", default=None, help="ramp: requests/s at --ramp-over")
    g.add_argument("--ramp-over", type=_number(0, True), default=None, metavar="S",
                   help="ramp: seconds to reach --ramp-to, then flat (default: --duration)")
    g.add_argument("--ramp-points", type=_arg_type(_ramp_points), default=None, metavar="T:RPS,...",
                   help="ramp: piecewise-linear points instead of --ramp-from/--ramp-to, e.g. 0:1,30:10,60:2")
    g.add_argument("--csv", default=None, metavar="FILE",
                   help="csv: rps per second, one row a second, optional header 'rps'; repeats if shorter "
                   "than --duration")
    g = p.add_argument_group("requests")
    g.add_argument("--prompt-len", type=_arg_type(parse_length), default="fixed:32", metavar="SPEC",
                   help="prompt length distribution: tokens, or words with --prompt-kind text (default: fixed:32)")
    g.add_argument("--output-len", type=_arg_type(parse_length), default="fixed:32", metavar="SPEC",
                   help="output tokens per request: max_tokens with ignore_eos (default: fixed:32)")
    g.add_argument("--prompt-kind", choices=("tokens", "text"), default="tokens",
                   help="random token ids (exact lengths) or random words (default: %(default)s)")
    g.add_argument("--vocab-size", type=_arg_type(_vocab_size), default=512, metavar="N", help="token-id prompts use ids in [5, N) (default: %(default)s)")
    g.add_argument("--adapters", type=_arg_type(parse_names), default=None, metavar="NAME,NAME",
                   help="model names to mix (base model and/or adapters); each request draws one")
    g.add_argument("--adapter-alpha", type=_number(0, False), default=1.0, metavar="ALPHA",
                   help="Zipf skew of --adapters: the i-th name (0-based) gets weight 1/(i+1)^alpha; 0 = uniform (default: %(default)s)")
    g.add_argument("--adapter-weights", type=_arg_type(parse_weights), default=None, metavar="W,W",
                   help="explicit weights of --adapters instead of Zipf")
    g.add_argument("--seed", type=int, default=0, help="seed of the arrival times and the requests (default: %(default)s)")
    g = p.add_argument_group("report")
    g.add_argument("--json", default=None, metavar="OUT", help="write the JSON report to OUT ('-': stdout)")
    g.add_argument("--plot", default=None, metavar="OUT.png",
                   help="write SLO attainment / rps over time to OUT.png and the TTFT / TPOT CDFs to OUT-cdf.png")
    g.add_argument("--slo-ttft", type=_number(0, True), default=None, metavar="S", help="TTFT bound (unbounded if unset)")
    g.add_argument("--slo-tpot", type=_number(0, True), default=None, metavar="S", help="TPOT bound (unbounded if unset)")
    g.add_argument("--bin-s", type=_number(0, True), default=None, metavar="S",
                   help="time-bin width of the timeline (default: max(1, duration/100))")
    g.add_argument("--no-scale-events", action="store_true",
                   help="do not poll GET /admin/status for the elastic server's scale events")
    g.add_argument("--quiet", action="store_true", help="no progress bar and no summary on stderr")
    return p


def build_schedule(args: argparse.Namespace) -> tuple[RateSchedule, float]:
    """The pattern and the duration; ValueError names the offending option."""
    duration = args.duration or DEFAULT_DURATION_S
    if args.pattern == "constant":
        return Constant(args.rps), duration
    if args.pattern == "poisson":
        return Poisson(args.rps), duration
    if args.pattern == "bursty":
        if args.rps_on is None:
            raise ValueError("--rps-on: required with --pattern bursty")
        return Bursty(args.rps_on, args.rps_off, args.on_s, args.off_s), duration
    if args.pattern == "ramp":
        if args.ramp_points is not None:
            try:
                return Ramp(args.ramp_points), duration
            except ValueError as exc:
                raise ValueError(f"--ramp-points: {exc}") from None
        if args.ramp_to is None:
            raise ValueError("--ramp-to: required with --pattern ramp (or give --ramp-points)")
        return Ramp.linear(args.ramp_from, args.ramp_to, args.ramp_over or duration), duration
    if args.csv is None:
        raise ValueError("--csv: required with --pattern csv")
    try:
        rates = parse_rate_csv(Path(args.csv).read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"--csv: {args.csv}: {exc}") from None
    return Patterned(rates), args.duration or float(len(rates))


def build_mix(args: argparse.Namespace) -> AdapterMix | None:
    """The model mix of --adapters, or --model alone; None when neither is given."""
    if args.adapters is None:
        if args.adapter_weights is not None:
            raise ValueError("--adapter-weights: needs --adapters")
        return None if args.model is None else AdapterMix.single(args.model)
    try:
        if args.adapter_weights is not None:
            return AdapterMix(tuple(args.adapters), tuple(args.adapter_weights))
        return AdapterMix.zipf(args.adapters, args.adapter_alpha)
    except ValueError as exc:
        raise ValueError(f"--adapters: {exc}") from None


async def first_model(url: str, api_key: str | None) -> str | None:
    """The first model id of `GET /v1/models`; None if the server does not answer."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        async with httpx.AsyncClient(base_url=url, headers=headers, timeout=10.0) as client:
            r = await client.get("/v1/models")
            r.raise_for_status()
            return str(r.json()["data"][0]["id"])
    except (httpx.HTTPError, ValueError, KeyError, IndexError):
        return None


class ProgressBar:
    """One self-overwriting stderr line: elapsed/duration, sent, done, failed, in flight."""

    def __init__(self, progress: LoadProgress, stream: TextIO, interval_s: float = 0.5, width: int = 24) -> None:
        self.progress, self.stream, self.interval_s, self.width = progress, stream, interval_s, width

    def line(self) -> str:
        p = self.progress
        frac = min(1.0, p.elapsed_s / p.duration_s) if p.duration_s > 0 else 1.0
        bar = "#" * int(frac * self.width) + "." * (self.width - int(frac * self.width))
        phase = "" if p.elapsed_s < p.duration_s else " draining"
        return (f"[load] {min(p.elapsed_s, p.duration_s):6.1f}/{p.duration_s:g}s [{bar}]{phase} sent {p.num_sent} "
                f"done {p.num_ok} failed {p.num_failed} in flight {p.num_in_flight}")

    async def run(self, done: asyncio.Event) -> None:
        while not done.is_set():
            self.stream.write("\r" + self.line() + "\x1b[K")
            self.stream.flush()
            try:
                await asyncio.wait_for(done.wait(), self.interval_s)
            except TimeoutError:
                pass
        p = self.progress
        self.stream.write(f"\r[load] finished after {p.elapsed_s:.1f}s: sent {p.num_sent} done {p.num_ok} "
                          f"failed {p.num_failed}\x1b[K\n")
        self.stream.flush()


async def _run(args: argparse.Namespace, spec: LoadSpec) -> LoadResult:
    progress = LoadProgress(spec.duration_s)
    stop, done = asyncio.Event(), asyncio.Event()
    install_stop_on_sigint(stop)
    bar = None
    if not args.quiet and sys.stderr.isatty():
        bar = asyncio.create_task(ProgressBar(progress, sys.stderr).run(done))
    try:
        return await run_load(spec, args.url, api_key=args.api_key, admin_key=args.admin_key,
                              request_timeout_s=args.timeout, stop=stop, progress=progress,
                              watch_scale_events=not args.no_scale_events)
    finally:
        done.set()
        if bar is not None:
            await bar


def build_report(args: argparse.Namespace, spec: LoadSpec, result: LoadResult) -> dict[str, Any]:
    """The JSON document (times in seconds since the load started; `started_at` is unix time)."""
    bin_s = args.bin_s or max(1.0, round(spec.duration_s / 100))
    bins = timeline(result.records, spec.schedule.rps, spec.duration_s, bin_s, args.slo_ttft, args.slo_tpot)
    return {
        "tool": "coordinator.bench.load",
        "config": {"url": args.url, **spec.to_dict(), "slo_ttft_s": args.slo_ttft, "slo_tpot_s": args.slo_tpot,
                   "timeout_s": args.timeout, "started_at": result.t0_wall},
        "summary": summarize(result.records, spec.duration_s, args.slo_ttft, args.slo_tpot),
        "timeline_bin_s": bin_s,
        "timeline": [dataclasses.asdict(b) for b in bins],
        "scale_events": result.scale_events,  # None: not watched, or no admin API
        "requests": [record_to_dict(r) for r in result.records],
    }


def format_summary(doc: dict[str, Any]) -> str:
    s = doc["summary"]

    def pct(d: dict[str, float | None]) -> str:
        return "/".join("-" if d[k] is None else f"{d[k]:.3f}" for k in ("p50", "p90", "p99"))

    rate = "-" if s["completed_rps"] is None else f"{s['completed_rps']:.2f}"
    lines = [
        f"requests {s['num_requests']} (ok {s['num_ok']}, failed {s['num_failed']}); offered "
        f"{s['offered_rps']:.2f} rps, completed {rate} rps, {s['output_tok_s'] or 0:.1f} output tok/s",
        f"TTFT p50/p90/p99 {pct(s['ttft_s'])} s; TPOT {pct(s['tpot_s'])} s; SLO attainment "
        + ("-" if s["slo"]["attainment"] is None else f"{100 * s['slo']['attainment']:.1f}%"),
    ]
    lines += [f"  {n}x {e}" for e, n in s["errors"].items()]
    if doc["scale_events"]:
        lines.append(f"scale events: {', '.join(e.get('event_id', '?') for e in doc['scale_events'])}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        schedule, duration = build_schedule(args)
        mix = build_mix(args)
    except ValueError as exc:
        parser.error(str(exc))
    if mix is None:
        model = asyncio.run(first_model(args.url, args.api_key))
        if model is None:  # the run goes ahead: its failures are the report
            print(f"warning: no --model and GET {args.url}/v1/models failed; sending model 'default'",
                  file=sys.stderr)
        mix = AdapterMix.single(model or "default")
    spec = LoadSpec(schedule, duration, mix, args.prompt_len, args.output_len, args.prompt_kind, args.vocab_size,
                    args.seed)
    result = asyncio.run(_run(args, spec))
    doc = build_report(args, spec, result)
    if not args.quiet:
        print(format_summary(doc), file=sys.stderr)
    if args.json == "-":
        json.dump(doc, sys.stdout, indent=1)
        sys.stdout.write("\n")
    elif args.json:
        Path(args.json).write_text(json.dumps(doc, indent=1) + "\n")
    if args.plot:
        from coordinator.bench.load_plots import cdf_path, plot_cdfs, plot_timeline

        plot_timeline(doc, args.plot)
        plot_cdfs(doc, cdf_path(args.plot))
    return 0


if __name__ == "__main__":
    sys.exit(main())
