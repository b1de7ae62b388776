"""CoServe on the elastic server: many adapters beyond their slots under a skewed Poisson load.

    python -m coordinator.bench.coserve --json --plot coserve.png

Writes `--num-lora` random LoRA adapters (rank `--lora-rank` on q_proj and v_proj) and
`--num-esft` ESFT adapters (`--esft-experts` random experts per MoE layer) once into
`--cache-dir` (reused by later runs). For each dp in `--dps` and each configuration in
`--configs` it starts the elastic server in-process (`--max-loras` LoRA slots per rank,
`--max-esft-adapters` ESFT slots; every LoRA adapter in the ranks' host memory), registers
every adapter over `POST /admin/adapters` (its popularity declared as `usage_probability`, what
an offline profile would give), sends the same seeded Poisson workload (`--rps` for
`--duration-s`; a request is for the base model with probability `--base-share`, else for an
adapter drawn by a power law of skew `--alpha` over all adapters, LoRA and ESFT mixed), and
stops the server. Configurations (CoServe, ASPLOS '25, Fig. 13):

  coserve    two-stage eviction + grouped arranging + CoServe assigning
  lru_fcfs   LRU eviction + FCFS arranging (Samba-CoE)
  fifo       FIFO eviction
  parallel   CoServe eviction + arranging, adapter-unaware least-loaded assigning
  resident   the same arrivals and adapters, a slot for every adapter they use (only those
             registered, all resident from the start): the adapters' compute, no swap
  reference  the same arrivals, every request on the base model (nothing registered, no swap)

`--rounds N` repeats every configuration N times in rotated orders and adds the medians.

Reported per run: output throughput, TTFT/TPOT p50/p99, failed requests, switches (LoRA
swaps-in per rank-group + ESFT swaps-in, server counters), hit rate (a LoRA request admitted with
its adapter in a slot, an ESFT request that did not wait for a swap-in; server counters), the
p99 TTFT of requests for "hot" adapters (base model and the `--max-loras` / `--max-esft-adapters`
most popular adapters of each kind) against the resident run (what others' swaps cost them) and
the reference run, the p99 TTFT of the requests whose adapter was resident on arrival (the server's
x-elasticmoe-adapter-state header) against the same requests in the resident run, and the Fig. 15
breakdown: time in adapter management (LoRA slot copies, per
rank, and ESFT swaps from start to resident), arranging (the ranks' schedulers) and assigning
(the ingress's router), all server-side timers.
The JSON document goes to stdout (--json) and/or --out, the tables to stderr, a figure to --plot.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import secrets
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx

from coordinator.bench.coserve_report import format_tables, plot
from coordinator.bench.coserve_workload import (
    ALL_CONFIGS,
    CONFIGS,
    REFERENCE,
    RESIDENT,
    Adapter,
    Arrival,
    build_adapters,
    counter_delta,
    hit_rate,
    latency_summary,
    make_arrivals,
    parse_metrics,
    popularity,
    progress,
    server_counters,
    used_adapters,
)
from coordinator.bench.loadgen import RequestRecord, stream_completion
from coordinator.bench.report_output import claim_stdout, emit
from coordinator.bench.server_admin import PRESETS
from elasticmoe.adapters.lora_targets import parse_target_modules
from elasticmoe.utils.ports import free_port

_GIB = 1 << 30


def register(url: str, adapters: list[Adapter]) -> float:
    """POST every adapter (4 at a time); seconds taken. Raises on any refusal."""
    start, done = time.monotonic(), 0

    def post(a: Adapter) -> None:
        with httpx.Client(base_url=url, timeout=120) as c:
            r = c.post("/admin/adapters", json={"name": a.name, "path": a.path, "usage_probability": a.share})
        if r.status_code != 201:
            raise RuntimeError(f"registering {a.name}: {r.status_code} {r.text[:200]}")

    with ThreadPoolExecutor(4) as pool:
        for _ in pool.map(post, adapters):
            done += 1
            if done % 200 == 0 or done == len(adapters):
                progress(f"registered {done}/{len(adapters)} adapters ({time.monotonic() - start:.1f} s)")
    return time.monotonic() - start


async def send_all(url: str, served: str, arrivals: list[Arrival], timeout_s: float) -> tuple[list[RequestRecord], float]:
    """Send `arrivals` at their times (streamed completions); the records and the span until the last finished."""
    records: list[RequestRecord] = []
    limits = httpx.Limits(max_connections=1024, max_keepalive_connections=256)
    async with httpx.AsyncClient(base_url=url, timeout=timeout_s, limits=limits) as client:
        t0 = time.monotonic()

        def now() -> float:
            return time.monotonic() - t0

        async def one(i: int, a: Arrival) -> None:
            await asyncio.sleep(max(0.0, a.arrival_s - now()))
            record = RequestRecord(i, now(), len(a.prompt), a.max_tokens, model=a.model)
            records.append(record)
            body = {"model": a.model or served, "prompt": a.prompt, "max_tokens": a.max_tokens, "temperature": 0,
                    "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
            await stream_completion(client, record, body, now)

        await asyncio.gather(*(one(i, a) for i, a in enumerate(arrivals)))
        return sorted(records, key=lambda r: r.request_id), now()


def _counters(url: str) -> tuple[dict[str, float], str | None]:
    """The server's counters, and how its ranks swap LoRA adapters (`adapter_swaps.lora_swaps`)."""
    with httpx.Client(base_url=url, timeout=30) as c:
        status = c.get("/admin/status").json()
        return server_counters(parse_metrics(c.get("/metrics").text), status), status["adapter_swaps"]["lora_swaps"]


def summarize(records: list[RequestRecord], span_s: float, hot: set[str | None], kind_of: dict[str, str],
              counters: dict[str, float] | None) -> dict[str, Any]:
    ok = [r for r in records if r.is_ok]
    hot_ok = [r for r in ok if r.model in hot]
    out: dict[str, Any] = {
        "num_requests": len(records), "failed": len(records) - len(ok),
        "errors": sorted({r.error or str(r.status) for r in records if not r.is_ok})[:5],
        "throughput_tok_s": sum(r.num_tokens for r in ok) / span_s if span_s > 0 else None,
        "throughput_req_s": len(ok) / span_s if span_s > 0 else None, "span_s": span_s,
        "ttft_s": latency_summary([r.ttft_s for r in ok]), "tpot_s": latency_summary([r.tpot_s for r in ok]),
        "hot_ttft_s": latency_summary([r.ttft_s for r in hot_ok]), "num_hot_requests": len(hot_ok),
        "cold_ttft_s": latency_summary([r.ttft_s for r in ok if r.model not in hot]),
        # By the server's x-elasticmoe-adapter-state header: requests whose adapter was resident on
        # arrival, and those that waited for a swap-in (`arrived_resident_vs_resident` pairs the first
        # with the same requests in the resident run, in `main`).
        "arrived_resident_ttft_s": latency_summary([r.ttft_s for r in ok if r.adapter_state == "resident"]),
        "num_arrived_resident": sum(r.adapter_state == "resident" for r in ok),
        "swapped_ttft_s": latency_summary([r.ttft_s for r in ok if r.adapter_state == "swapped"]),
        "num_swapped": sum(r.adapter_state == "swapped" for r in ok),
    }
    if counters is not None:
        num_esft = sum(kind_of.get(r.model or "") == "esft" for r in records)
        rate, hits, misses = hit_rate(counters, num_esft)
        out.update(counters=counters, switches=counters["lora_swaps_in"] + counters["esft_swaps_in"],
                   hit_rate=rate, hits=hits, misses=misses, breakdown_s={
                       "management": counters["lora_swap_s"] + counters["esft_swap_s"],
                       "management_lora": counters["lora_swap_s"], "management_esft": counters["esft_swap_s"],
                       "arranging": counters["arranging_s"], "assigning": counters["assigning_s"]})
    return out


def run_one(args: argparse.Namespace, config: str, dp: int, adapters: list[Adapter], arrivals: list[Arrival],
            hot: set[str | None]) -> dict[str, Any]:
    from coordinator.config import CoordinatorConfig
    from coordinator.launch import start_elastic

    eviction, arranging, assigning = CONFIGS.get(config, CONFIGS["coserve"])
    to_register = {REFERENCE: [], RESIDENT: used_adapters(adapters, arrivals)}.get(config, adapters)
    num_lora = sum(a.kind == "lora" for a in to_register)
    num_esft = len(to_register) - num_lora
    max_loras, max_esft = args.max_loras, args.max_esft_adapters
    if config == RESIDENT:  # a slot each: registration fills them, nothing is swapped after
        max_loras, max_esft = max(max_loras, num_lora), max(max_esft, num_esft)
    cfg = CoordinatorConfig.model_validate(dict(
        model_dir=args.model, num_devices=max(args.dps), dp=dp, dtype=args.dtype,
        device_memory_bytes=int(args.device_memory_gb * _GIB), kv_bytes_per_device=int(args.kv_cache_gb * _GIB),
        served_model_name="base", shm_prefix=f"emoecoserve{secrets.token_hex(4)}", standby_pool=False,
        max_queued=4096, max_loras=max_loras, max_lora_rank=args.lora_rank, lora_target_modules=args.lora_target_modules,
        max_cpu_loras=max(num_lora, max_loras), max_esft_adapters=max_esft,
        max_esft_experts=args.esft_experts, adapter_eviction=eviction, request_arranging=arranging,
        request_assigning=assigning, num_threads=args.num_threads,
        **({"max_num_batched_tokens": args.max_num_batched_tokens} if args.max_num_batched_tokens else {})))
    progress(f"{config} dp {dp}: starting the server")
    t = time.monotonic()
    server = start_elastic(cfg, port=free_port())
    row: dict[str, Any] = {"config": config, "dp": dp, "eviction": eviction, "arranging": arranging,
                           "assigning": assigning, "start_s": time.monotonic() - t, "max_loras": max_loras,
                           "max_esft_adapters": max_esft}
    try:
        row["register_s"] = register(server.url, to_register) if to_register else 0.0
        row["num_registered"] = len(to_register)
        before = _counters(server.url)[0] if to_register else None
        sent = arrivals if to_register else [Arrival(a.arrival_s, None, a.prompt, a.max_tokens) for a in arrivals]
        progress(f"{config} dp {dp}: {len(sent)} requests over {args.duration_s:.0f} s")
        records, span = asyncio.run(send_all(server.url, "base", sent, args.request_timeout_s))
        counters = None
        if before is not None:
            after, row["lora_swaps"] = _counters(server.url)
            counters = counter_delta(after, before)
        kind_of = {a.name: a.kind for a in adapters}
        # NOTE: the reference run's hot requests are the ones that are hot in the adapter runs.
        row.update(summarize(records, span, hot if to_register else {None}, kind_of, counters))
        row["_ttft_by_id"] = {r.request_id: r.ttft_s for r in records if r.is_ok}  # for `pair_arrived_resident`
        row["_arrived_resident_ids"] = [r.request_id for r in records if r.is_ok and r.adapter_state == "resident"]
        if not to_register:
            hot_ids = {i for i, a in enumerate(arrivals) if a.model in hot}
            row["hot_ttft_s"] = latency_summary([r.ttft_s for r in records if r.request_id in hot_ids and r.is_ok])
    finally:
        server.shutdown()
    progress(f"{config} dp {dp}: {row.get('failed')} failed, switches {row.get('switches')}, "
             f"hit rate {row.get('hit_rate')}, {row.get('throughput_tok_s') or 0:.1f} tok/s")
    return row


def rotated(configs: list[str], round_index: int) -> list[str]:
    """The configurations in the order of round `round_index`: each round starts one further on, so
    that no configuration always runs first (or right after the same one)."""
    k = round_index % len(configs)
    return configs[k:] + configs[:k]


def pair_arrived_resident(rows: list[dict[str, Any]]) -> None:
    """Each run's requests whose adapter was resident on arrival against the same requests in the
    resident run at its dp and round (every adapter resident there, so no switch delays them): the ratio of
    their p99 TTFTs is what others' swaps cost them (`arrived_resident_vs_resident`; None without a
    resident run). Drops the rows' per-request scratch fields."""
    for row in rows:
        base = next((r for r in rows if r["dp"] == row["dp"] and r["config"] == RESIDENT
                     and r.get("round", 0) == row.get("round", 0)), None)
        ids = row.get("_arrived_resident_ids") or []
        ratio = None
        if base is not None and ids and row["config"] != RESIDENT:
            mine = latency_summary([row["_ttft_by_id"].get(i) for i in ids])["p99"]
            theirs = latency_summary([base["_ttft_by_id"].get(i) for i in ids])["p99"]
            ratio = mine / theirs if mine is not None and theirs else None
        row["arrived_resident_vs_resident"] = ratio
    for row in rows:
        row.pop("_ttft_by_id", None)
        row.pop("_arrived_resident_ids", None)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="\n".join(__doc__.splitlines()[2:]))
    p.add_argument("--preset", choices=sorted(PRESETS), default="small")
    p.add_argument("--model", default=None, help="base checkpoint dir (default: the preset's, built if missing)")
    p.add_argument("--dtype", choices=["bfloat16", "float32"], default="float32")
    p.add_argument("--num-lora", type=int, default=1000, help="LoRA adapters registered")
    p.add_argument("--num-esft", type=int, default=100, help="ESFT adapters registered")
    p.add_argument("--lora-rank", type=int, default=8)
    p.add_argument("--esft-experts", type=int, default=1, help="tuned experts per MoE layer of each ESFT adapter")
    p.add_argument("--max-loras", type=int, default=8, help="LoRA slots per rank")
    p.add_argument("--lora-target-modules", default=None, metavar="NAMES",
                   help="the modules the LoRA slots hold (the bench's adapters adapt q_proj,v_proj; default: every "
                        "module, whose expert sites are most of a slot's bytes)")
    p.add_argument("--max-esft-adapters", type=int, default=4, help="ESFT slots")
    p.add_argument("--dps", default="1,2", help="comma list of dp (= ep) sizes")
    p.add_argument("--configs", default=",".join(ALL_CONFIGS), help=f"comma list of {', '.join(ALL_CONFIGS)}")
    p.add_argument("--rps", type=float, default=2.5, help="Poisson arrival rate")
    p.add_argument("--duration-s", type=float, default=40.0, help="seconds of arrivals per run")
    p.add_argument("--rounds", type=int, default=1,
                   help="run every configuration this many times, round r starting with the r-th (saturated runs "
                        "vary from run to run by more than the configurations differ: the tables add medians)")
    p.add_argument("--alpha", type=float, default=0.1,
                   help="power-law skew of adapter popularity (smaller: more skewed; S-LoRA uses 0.3 and 0.1)")
    p.add_argument("--base-share", type=float, default=0.1, help="share of requests for the base model")
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--num-threads", type=int, default=1, help="PyTorch threads per rank")
    p.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help="the ranks' token budget per step (default: the engine's)")
    p.add_argument("--device-memory-gb", type=float, default=None)
    p.add_argument("--kv-cache-gb", type=float, default=None)
    p.add_argument("--request-timeout-s", type=float, default=300.0)
    p.add_argument("--cache-dir", default=".cache/coserve-adapters", help="where adapters are written once and reused")
    p.add_argument("--json", action="store_true", help="the JSON document on stdout")
    p.add_argument("--out", default=None, help="also write the JSON document here")
    p.add_argument("--plot", default=None, help="write a PNG (Fig. 13 bars and the Fig. 15 breakdown)")
    args = p.parse_args(argv)
    args.dps = [int(x) for x in args.dps.split(",")]
    args.configs = [c.strip() for c in args.configs.split(",")]
    if bad := sorted(set(args.configs) - set(ALL_CONFIGS)):
        p.error(f"--configs: unknown {bad}; want some of {', '.join(ALL_CONFIGS)}")
    try:
        parse_target_modules(args.lora_target_modules, "--lora-target-modules")
    except ValueError as exc:
        p.error(str(exc))
    if min(args.dps) < 1 or args.num_lora < 0 or args.num_esft < 0 or args.num_lora + args.num_esft < 1:
        p.error("--dps entries >= 1; --num-lora, --num-esft >= 0 with at least one adapter")
    if args.rounds < 1:
        p.error(f"--rounds: must be >= 1, got {args.rounds}")
    if args.max_num_batched_tokens is not None and args.max_num_batched_tokens < 1:
        p.error(f"--max-num-batched-tokens: must be >= 1, got {args.max_num_batched_tokens}")
    preset = PRESETS[args.preset]
    args.model = args.model or preset[0]
    args.device_memory_gb = args.device_memory_gb or preset[1]
    args.kv_cache_gb = args.kv_cache_gb or preset[2]
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not (Path(args.model) / "config.json").is_file():
        from elasticmoe.tools.make_model import make_model

        progress(f"building {args.model} (make-model --arch qwen3_moe --preset {args.preset} --seed 0)")
        make_model("qwen3_moe", args.preset, seed=0, out=args.model)
    import ray

    from coordinator.process_tree import become_subreaper, end_children
    from elasticmoe.config import ModelConfig
    from hmm.local_ray import init_local_ray
    from hmm.placement import DEVICE_RESOURCE

    json_out = claim_stdout()
    cache = Path(args.cache_dir) / Path(args.model).name
    built, build_s = build_adapters(args.model, cache, args.num_lora, args.num_esft, args.lora_rank,
                                    args.esft_experts, progress)
    shares = popularity([name for name, _, _ in built], args.alpha, args.seed)
    adapters = [Adapter(name, kind, path, shares[name]) for name, kind, path in built]
    hot: set[str | None] = {None}
    for kind, slots in (("lora", args.max_loras), ("esft", args.max_esft_adapters)):
        hot |= {a.name for a in sorted((a for a in adapters if a.kind == kind), key=lambda a: -a.share)[:slots]}
    vocab = ModelConfig.from_pretrained(args.model).vocab_size
    arrivals = make_arrivals(shares, args.base_share, args.rps, args.duration_s, args.prompt_len, args.max_tokens,
                             vocab, args.seed)
    progress(f"{len(adapters)} adapters ready ({build_s:.0f} s to write), {len(arrivals)} requests per run")
    become_subreaper()
    init_local_ray(num_cpus=2, log_to_driver=False, resources={DEVICE_RESOURCE: max(args.dps)})
    rows = []
    try:
        for dp in args.dps:
            for round_index in range(args.rounds):
                for config in rotated(args.configs, round_index):
                    rows.append({**run_one(args, config, dp, adapters, arrivals, hot), "round": round_index})
    finally:
        ray.shutdown()
        end_children()
    pair_arrived_resident(rows)
    doc = {"benchmark": "coordinator.bench.coserve",
           "config": {k: v for k, v in vars(args).items() if k not in ("json", "out", "plot")},
           "machine": {"cpus": os.cpu_count(), "load_average": os.getloadavg()},
           "num_adapters": {"lora": args.num_lora, "esft": args.num_esft}, "adapter_write_s": build_s,
           "num_requests": len(arrivals), "hot_adapters": sorted(n for n in hot if n is not None), "runs": rows}
    emit(doc, format_tables(doc), json_out, as_json=args.json, out_path=args.out, plot_path=args.plot, plot=plot,
         progress=progress)
    return 0 if all(r["failed"] == 0 for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
