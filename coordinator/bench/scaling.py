"""Scale-event benchmark: latency, downtime, peak memory, throughput and SLOs per strategy.

    python -m coordinator.bench.scaling --strategy all --json --plot scaling.png

Starts an in-process elastic server, and for every (strategy, transition) runs a
fresh seeded Poisson load over HTTP: warm-up (and the server's standby preparation)
-> `POST /admin/scale` -> poll until the event ends -> through the fixed `during`
span and W more seconds -> stop arrivals and let requests finish. Reports
per event the server's figures (scale latency, critical-section downtime, peak
memory summed over devices) beside the client's (longest token gap in the event
window and in a no-scale window before it, failed requests, output tokens/s
before / during / after: ElasticMoE Table 2), each strategy's latency over cold
restart's for the same transition (§7.4), the cumulative-ablation table for one
transition (Table 1) and a plot of SLO attainment over time (Fig. 9). Between
events the server is moved back to the start dp with an unmeasured elastic scale.

With `--backend vllm` every rank runs vLLM (the `vllm` extra: run this from .venv-vllm) as a
data-parallel replica holding every expert; the same events then measure vLLM's replicas scaling
(paper Fig. 1's horizontal baseline), `cold_restart` being vLLM restarted on the same machine
(processes, vLLM import, engine build, the model read from disk). Each event also reports the
rank processes' private memory at its peak (`peak_rank_private_bytes`: what vLLM repacks, its KV
cache and runtime; the HMM's `peak_memory_bytes` counts the shared weights only), and the output
throughput before the POST is the old dp's under this load: run a saturating `--rps` to compare the
backends' throughput at one dp.

With `--nodes D0,D1,...` the server runs on a Ray cluster of that many nodes on this machine
(each offering that many devices, the head first; token authentication on), so a transition
onto another node's devices crosses nodes: its bytes go by p2p over gloo, reported per event
beside those read from disk (`bytes_moved`), and the Ray nodes the new instance's ranks run on.
With `--netns` as well, each node but the head runs in its own network namespace behind a veth
pair (needs root): cross-node bytes really cross a network interface, and each event reports
how many bytes the nodes' veths carried from the POST to the event's end (`veth_bytes`).

    python -m coordinator.bench.scaling --nodes 1,1 --transitions 1-2,2-1 --strategy elastic,cold_restart
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import logging
import secrets
import sys
from pathlib import Path
from typing import Any

import httpx

from coordinator.bench.loadgen import LoadResult, PoissonLoad, Workload
from coordinator.bench.local_nodes import RayNodes, attached, parse_nodes, ray_nodes, run_attached
from coordinator.bench.rank_memory import RankMemorySampler
from coordinator.bench.report_output import claim_stdout, emit, progress_printer
from coordinator.bench.scale_metrics import (
    EventKey,
    baseline_window,
    event_windows,
    failed_requests,
    latency_ratios,
    max_token_gap,
    output_throughput,
    slo_attainment_bins,
)
from coordinator.bench.scaling_report import fmt, format_tables, plot_slo
from coordinator.bench.server_admin import (
    PRESETS,
    ensure_dp,
    resolve_model,
    wait_event,
    wait_standby,
)
from elasticmoe.utils.ports import free_port

logger = logging.getLogger(__name__)
_progress = progress_printer("scaling")

STRATEGIES = ("elastic", "cold_restart", "extravagant", "concurrent")
ABLATIONS = ("no_ipc_alloc", "no_p2p", "no_preinit", "no_zero_copy")  # cumulative, paper Table 1
ABLATION_LABELS = {"elastic": "ElasticMoE (full)", "no_ipc_alloc": "- IPCAlloc", "no_p2p": "- P2P",
                   "no_preinit": "- PreInit", "no_zero_copy": "- ZeroCopy"}
_GIB = 1 << 30


@dataclasses.dataclass(frozen=True, slots=True)
class Run:
    """One measured scale event."""

    strategy: str
    from_dp: int
    to_dp: int


# ---- plan --------------------------------------------------------------------------------


def parse_transitions(text: str) -> list[tuple[int, int]]:
    """"2-3,3-2" -> [(2, 3), (3, 2)]; a chain "1-2-4" -> [(1, 2), (2, 4)]."""
    out: list[tuple[int, int]] = []
    for part in text.split(","):
        dps = [int(x) for x in part.strip().split("-")]
        if len(dps) < 2 or any(d < 1 for d in dps) or any(a == b for a, b in zip(dps, dps[1:], strict=False)):
            raise ValueError(f"--transitions: bad transition {part!r} (want e.g. 2-3 or 1-2-4)")
        out.extend(zip(dps, dps[1:], strict=False))
    return out


def plan_runs(strategy: str, transitions: list[tuple[int, int]], ablation: tuple[int, int]) -> list[Run]:
    """The measured events, in order: strategies over all transitions, then the ablation set.

    `strategy`: "all", "ablations", or a comma-separated list of strategies (and "ablations").
    """
    names = [n.strip() for n in strategy.split(",")]
    bad = [n for n in names if n not in ("all", "ablations", *STRATEGIES)]
    if bad or not names:
        raise ValueError(f"--strategy: unknown {bad}; want all, ablations or some of {', '.join(STRATEGIES)}")
    chosen = STRATEGIES if "all" in names else tuple(n for n in STRATEGIES if n in names)
    runs = [Run(s, a, b) for s in chosen for a, b in transitions]
    if "all" in names or "ablations" in names:
        if Run("elastic", *ablation) not in runs:
            runs.append(Run("elastic", *ablation))
        runs += [Run(s, *ablation) for s in ABLATIONS]
    return runs


def devices_needed(runs: list[Run]) -> int:
    """Extravagant scaling puts the new instance on fresh devices: it needs from + to."""
    return max(r.from_dp + r.to_dp if r.strategy == "extravagant" else max(r.from_dp, r.to_dp) for r in runs)


# ---- one event ---------------------------------------------------------------------------


@dataclasses.dataclass
class Measured:
    run: Run
    load: LoadResult
    post_s: float  # on the load's time axis
    finished_s: float
    http_status: int
    event: dict[str, Any]  # the server's event (or {"error": ...} if the POST was refused)
    rank_nodes: list[str | None] = dataclasses.field(default_factory=list)  # Ray node of each new rank
    veth_bytes: int | None = None  # with --netns: what the worker nodes' veths carried, POST to event end


def _veth_bytes(cluster: RayNodes | None) -> int | None:
    return sum(cluster.interface_bytes().values()) if cluster is not None and cluster.network else None


async def measure(client: httpx.AsyncClient, model: str, run: Run, args: argparse.Namespace,
                  cluster: RayNodes | None = None) -> Measured:
    """Load -> warm-up -> scale -> poll -> W s more -> stop; the records and the server's event
    (and, on namespaced nodes, the bytes their veths carried meanwhile: Ray's traffic and the
    load's requests included)."""
    workload = Workload(prompt_len=args.prompt_len, max_tokens=args.max_tokens, vocab_size=args.vocab_size)
    load = PoissonLoad(str(client.base_url), model, args.rps, workload, seed=args.seed)
    stop = asyncio.Event()
    task = asyncio.create_task(load.run(stop))
    await asyncio.sleep(args.warmup_s)
    await wait_standby(client, args.event_timeout_s, _progress)
    post_s = load.now()
    _progress(f"{run.strategy}: POST /admin/scale dp {run.from_dp} -> {run.to_dp} "
              f"({len(load.records)} requests so far)")
    rank_memory: RankMemorySampler = args.rank_memory
    private_before = await asyncio.to_thread(rank_memory.reset)
    veth_before = _veth_bytes(cluster)
    r = await client.post("/admin/scale", json={"dp": run.to_dp, "strategy": run.strategy})
    if r.status_code == 202:
        event = await wait_event(client, r.json()["event_id"], args.event_timeout_s)
    else:
        event = {"state": "rejected", "error": r.text[:300]}
    finished_s = load.now()
    # NOTE: on --nodes the ranks descend from the nodes' raylets, not from this driver, so none is
    # found: None ("-"), not a measured 0.
    peak_private = await asyncio.to_thread(rank_memory.peak)
    event = {**event, "rank_private_before_bytes": private_before or None,
             "peak_rank_private_bytes": peak_private or None}
    veth_after = _veth_bytes(cluster)
    veth = veth_after - veth_before if veth_after is not None and veth_before is not None else None
    if event.get("strategy") not in (None, run.strategy):
        _progress(f"warning: asked for {run.strategy!r}, the server ran {event['strategy']!r}")
    _progress(f"{run.strategy}: event {event.get('event_id', '-')} {event['state']} after "
              f"{finished_s - post_s:.2f}s" + (f" ({event['error']})" if event.get("error") else ""))
    # Load runs through the `during` span and the W s `after` window.
    await asyncio.sleep(max(0.0, post_s + args.during_s - load.now()) + max(args.window_s, 1.0))
    stop.set()
    result = await task
    if event.get("finished_at") is not None:
        finished_s = max(post_s, result.to_rel(event["finished_at"]))
    status = (await client.get("/admin/status")).json()
    rank_nodes = [r["ray_node_id"] for r in (status.get("instance") or {}).get("ranks", [])]
    return Measured(run, result, post_s, finished_s, r.status_code, event, rank_nodes, veth)


def summarize(m: Measured, args: argparse.Namespace) -> dict[str, Any]:
    """The per-event JSON record (times in seconds, memory in bytes, throughput in output tokens/s)."""
    records, ev = m.load.records, m.event
    w = event_windows(m.post_s, m.finished_s, args.window_s, args.during_s)
    base = baseline_window(m.post_s, w.event.length_s)
    applied = ev.get("strategy")
    bins = slo_attainment_bins(records, dataclasses.replace(w.before, end_s=w.after.end_s),
                               args.slo_ttft_s, args.slo_tpot_s)
    return {
        "strategy": m.run.strategy,
        "from_dp": m.run.from_dp,
        "to_dp": m.run.to_dp,
        "event_id": ev.get("event_id"),
        "state": ev["state"],  # succeeded | rolled_back | rejected (POST not 202) | running (timed out)
        "http_status": m.http_status,
        "strategy_applied": applied,  # what the server says it ran
        "strategy_ignored": applied is not None and applied != m.run.strategy,  # figures are not the strategy's
        "error": ev.get("error"),
        "scale_latency_s": ev.get("scale_latency_s"),
        "downtime_s": ev.get("downtime_s"),
        "client_downtime_s": max_token_gap(records, w.event),
        "baseline_client_downtime_s": max_token_gap(records, base),
        "event_window_s": w.event.length_s,
        "baseline_window_s": base.length_s,
        "peak_memory_bytes": ev.get("peak_memory_bytes"),
        "rank_private_before_bytes": ev.get("rank_private_before_bytes"),  # rank processes' RssAnon at the POST
        "peak_rank_private_bytes": ev.get("peak_rank_private_bytes"),  # ... at its peak until the event ended
        "requests_in_flight": ev.get("requests_in_flight"),
        "requests_handed_over": ev.get("requests_handed_over"),
        "bytes_moved": ev.get("bytes_moved"),
        "expert_rows_warmed": ev.get("expert_rows_warmed"),  # offloading: cache rows filled before serving
        "expert_load_imbalance": ev.get("expert_load_imbalance"),  # target placement: busiest rank / mean  # by source: disk, local copy, p2p within a node, p2p over gloo
        "num_rank_nodes": len(set(m.rank_nodes)),  # Ray nodes of the instance after the event
        "veth_bytes": m.veth_bytes,  # --netns: bytes over the worker nodes' veths, POST to event end
        "failed_requests": failed_requests(records, w.event),
        "failed_requests_total": failed_requests(records),
        "errors": sorted({f"{r.status}: {r.error}" for r in records if not r.is_ok})[:5],  # distinct, first 5
        "num_requests": len(records),
        "throughput_tok_s": {
            "before": output_throughput(records, w.before),
            "during": output_throughput(records, w.during),
            "after": output_throughput(records, w.after),
        },
        "latency_ratio_vs_cold_restart": None,  # filled in once every event is measured
        "post_s": m.post_s,
        "finished_s": m.finished_s,
        "slo_bins": [{"t_s": b.start_s - m.post_s, "num_requests": b.num_requests, "attainment": b.attainment}
                     for b in bins],
    }


def ablation_table(events: list[dict[str, Any]], transition: tuple[int, int]) -> list[dict[str, Any]]:
    """Paper Table 1: scale time, downtime and peak memory of elastic and each cumulative ablation."""
    rows = []
    for strategy in ("elastic", *ABLATIONS):
        for e in events:
            if (e["strategy"], e["from_dp"], e["to_dp"]) == (strategy, *transition):
                state = f"{e['state']} (ran {e['strategy_applied']})" if e["strategy_ignored"] else e["state"]
                rows.append({"configuration": ABLATION_LABELS[strategy], "strategy": strategy, "state": state, "scale_latency_s": e["scale_latency_s"],
                             "downtime_s": e["downtime_s"], "client_downtime_s": e["client_downtime_s"],
                             "peak_memory_bytes": e["peak_memory_bytes"]})
                break
    return rows


# ---- main --------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m coordinator.bench.scaling",
        description="Measure scale events of the elastic server under steady Poisson load (ElasticMoE §7.4-7.7).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--strategy", default="all", metavar="all|ablations|NAME[,NAME]",
                   help=f"what to measure: strategies ({', '.join(STRATEGIES)}; comma-separated) over every "
                   f"transition; 'ablations' = elastic and the cumulative ablations {', '.join(ABLATIONS)} on "
                   "--ablation-transition; 'all' = the four strategies plus the ablation set")
    p.add_argument("--preset", default="small", choices=sorted(PRESETS),
                   help="model when --model is not given (models/<preset>-qwen3-moe, built if missing); also "
                   "sets the default device memory and KV cache sizes")
    p.add_argument("--model", default=None, metavar="DIR", help="model directory (overrides --preset's)")
    p.add_argument("--backend", default="native", choices=["native", "vllm"],
                   help="engine of every rank (vllm: data-parallel replicas; needs the `vllm` extra, and with "
                   "--preset tiny uses models/tiny-vllm-qwen3-moe)")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"], help="weights and KV dtype")
    p.add_argument("--devices", type=int, default=None, metavar="N",
                   help="logical devices to register (default: as many as the planned events need; "
                   "extravagant needs from+to)")
    p.add_argument("--nodes", default=None, metavar="D0,D1,...",
                   help="run on a Ray cluster of these nodes on this machine, each offering that many devices "
                   "(the head first; --devices is then their sum): transitions onto another node's devices "
                   "cross nodes")
    p.add_argument("--netns", action="store_true",
                   help="with --nodes: each node but the head in its own network namespace, joined to the host "
                   "by a veth pair on a bridge (needs root), so cross-node bytes cross a network interface; "
                   "each event reports the bytes the veths carried (veth_bytes)")
    p.add_argument("--device-memory-gb", type=float, default=None, metavar="G",
                   help="memory budget per device in GiB (default: per preset)")
    p.add_argument("--kv-cache-gb", type=float, default=None, metavar="G",
                   help="KV cache per device in GiB (default: per preset)")
    p.add_argument("--expert-cache-fraction", type=float, default=None, metavar="F",
                   help="offload the experts: each device caches this fraction of its experts at the first dp "
                   "(the server's --expert-cache-fraction; default: every expert resident)")
    p.add_argument("--expert-tier", default="host", choices=("host", "disk"),
                   help="with --expert-cache-fraction: the experts a cache misses come from the nodes' memory (host) "
                   "or from the checkpoint only (disk; the server's --expert-tier)")
    p.add_argument("--offload-policy", default="finemoe", choices=("finemoe", "lru", "lfu", "on_demand"),
                   help="the expert cache's policy with --expert-cache-fraction")
    p.add_argument("--transitions", default="2-3,3-2", metavar="A-B[,C-D]",
                   help="dp transitions measured per strategy, comma-separated; a chain like 1-2-4 means 1->2 "
                   "then 2->4. The server is moved to each start dp with an unmeasured elastic scale")
    p.add_argument("--ablation-transition", default="2-3", metavar="A-B",
                   help="the transition of the ablation table (paper Table 1)")
    p.add_argument("--rps", type=float, default=2.0, help="Poisson arrival rate, requests/s")
    p.add_argument("--seed", type=int, default=0, help="seed of arrivals and prompts (same for every event)")
    p.add_argument("--warmup-s", type=float, default=10.0,
                   help="seconds of load before the scale POST (the 'before' window is its last --window-s)")
    p.add_argument("--window-s", type=float, default=10.0,
                   help="W: throughput windows are the W s before the POST and the W s after the event ended; "
                   "load runs W s past the event")
    p.add_argument("--during-s", type=float, default=10.0,
                   help="the 'during' throughput window: this many seconds from the POST (or the event, if "
                   "longer), the same span for every strategy as in paper Table 2")
    p.add_argument("--prompt-len", type=_range, default=(32, 32), metavar="N|LO-HI",
                   help="prompt tokens (random ids), fixed or a uniform range")
    p.add_argument("--max-tokens", type=_range, default=(32, 32), metavar="N|LO-HI",
                   help="output tokens per request (ignore_eos), fixed or a uniform range")
    p.add_argument("--slo-ttft-s", type=float, default=5.0, help="SLO on time to first token, seconds")
    p.add_argument("--slo-tpot-s", type=float, default=1.5, help="SLO on mean time per output token, seconds")
    p.add_argument("--event-timeout-s", type=float, default=600.0,
                   help="give up waiting for a scale event after this many seconds")
    p.add_argument("--port", type=int, default=0, help="HTTP port of the server (0: a free one)")
    p.add_argument("--json", action="store_true", help="print the results as one JSON document on stdout")
    p.add_argument("--out", default=None, metavar="FILE", help="also write the JSON document to FILE")
    p.add_argument("--plot", default=None, metavar="FILE", help="write the SLO-attainment plot (PNG) to FILE")
    return p


def _range(text: str) -> tuple[int, int]:
    lo, _, hi = text.partition("-")
    bounds = (int(lo), int(hi or lo))
    if not 1 <= bounds[0] <= bounds[1]:
        raise argparse.ArgumentTypeError(f"want N or LO-HI with 1 <= LO <= HI, got {text!r}")
    return bounds


async def run_events(url: str, runs: list[Run], args: argparse.Namespace,
                     cluster: RayNodes | None = None) -> list[dict[str, Any]]:
    events = []
    async with httpx.AsyncClient(base_url=url, timeout=60.0) as client:
        model = (await client.get("/v1/models")).json()["data"][0]["id"]
        for i, run in enumerate(runs):
            _progress(f"event {i + 1}/{len(runs)}: {run.strategy} dp {run.from_dp} -> {run.to_dp}")
            await ensure_dp(client, run.from_dp, args.event_timeout_s, _progress)
            m = await measure(client, model, run, args, cluster)
            events.append(summarize(m, args))
            e = events[-1]
            _progress(f"{run.strategy}: latency {fmt(e['scale_latency_s'])}s, client downtime "
                      f"{e['client_downtime_s']:.2f}s (baseline {e['baseline_client_downtime_s']:.2f}s), "
                      f"failed {e['failed_requests']}/{e['num_requests']}")
    keys = [(EventKey(e["strategy"], e["from_dp"], e["to_dp"]),
             e["scale_latency_s"] if e["state"] == "succeeded" and not e["strategy_ignored"] else None)
            for e in events]
    for e, ratio in zip(events, latency_ratios(keys), strict=True):
        e["latency_ratio_vs_cold_restart"] = ratio
    return events


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    try:
        transitions = parse_transitions(args.transitions)
        (ablation,) = parse_transitions(args.ablation_transition)
        runs = plan_runs(args.strategy, transitions, ablation)
        nodes = parse_nodes(args.nodes) if args.nodes else None
        if args.netns and nodes is None:
            raise ValueError("--netns: needs --nodes")
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    model_dir = resolve_model(args, _progress)
    args.vocab_size = int(json.loads((Path(model_dir) / "config.json").read_text())["vocab_size"])
    preset = PRESETS[args.preset]
    devices = sum(nodes) if nodes else (args.devices or devices_needed(runs))
    if devices < devices_needed(runs):
        _progress(f"warning: --devices {devices} < {devices_needed(runs)} needed; some events will be refused")
    cluster = attached()
    if nodes is not None and cluster is None:  # start the nodes, then measure on them as their driver
        _progress(f"starting a Ray cluster of {len(nodes)} nodes offering {list(nodes)} devices")
        with ray_nodes(head_devices=nodes[0], worker_devices=nodes[1:], netns=args.netns) as started:
            return run_attached(started, "coordinator.bench.scaling", sys.argv[1:] if argv is None else argv)

    from coordinator.config import CoordinatorConfig
    from coordinator.launch import start_elastic

    json_out = claim_stdout()

    config = CoordinatorConfig(
        model_dir=model_dir, num_devices=devices, dp=runs[0].from_dp, dtype=args.dtype,
        device_memory_bytes=int((args.device_memory_gb or preset[1]) * _GIB),
        kv_bytes_per_device=int((args.kv_cache_gb or preset[2]) * _GIB),
        max_queued=256, shm_prefix=f"emoescaling{secrets.token_hex(4)}", backend=args.backend,
        expert_cache_fraction=args.expert_cache_fraction, offload_policy=args.offload_policy,
        expert_tier=args.expert_tier,
    )
    address = cluster.address if cluster is not None else None
    _progress(f"starting the elastic server: {model_dir}, {devices} devices, dp {config.dp}, {args.dtype}")
    server = start_elastic(config, port=args.port or free_port(), address=address,
                           ray_init_kwargs={"log_to_driver": False} if address else {"num_cpus": 2, "log_to_driver": False})
    try:
        with RankMemorySampler() as args.rank_memory:
            events = asyncio.run(run_events(server.url, runs, args, cluster))
    finally:
        _progress("shutting the server down")
        server.shutdown()
    doc = {
        "benchmark": "coordinator.bench.scaling",
        "config": {
            "model": model_dir, "backend": args.backend, "dtype": args.dtype, "devices": devices, "nodes": nodes,
            "netns": args.netns,
            "expert_cache_fraction": args.expert_cache_fraction,
            "offload_policy": args.offload_policy if args.expert_cache_fraction is not None else None,
            "expert_tier": args.expert_tier if args.expert_cache_fraction is not None else None,
            "device_memory_bytes": config.device_memory_bytes, "kv_bytes_per_device": config.kv_bytes_per_device,
            "strategy": args.strategy,
            "transitions": transitions, "ablation_transition": ablation, "rps": args.rps, "seed": args.seed,
            "warmup_s": args.warmup_s, "window_s": args.window_s, "during_s": args.during_s,
            "prompt_len": args.prompt_len,
            "max_tokens": args.max_tokens, "slo_ttft_s": args.slo_ttft_s, "slo_tpot_s": args.slo_tpot_s,
        },
        "events": events,
        "ablation": ablation_table(events, ablation) if {"all", "ablations"} & set(args.strategy.split(",")) else [],
    }
    emit(doc, format_tables(doc), json_out, as_json=args.json, out_path=args.out, plot_path=args.plot,
         plot=plot_slo, progress=_progress)
    return 0


if __name__ == "__main__":
    sys.exit(main())
