"""Multi-LoRA serving benchmark (MoLoRA §5-7): per-token routing, slot overhead, hot-set swapping.

    python -m elasticmoe.bench.lora [--preset small|tiny] [--model DIR] --json

Adapters are random rank-`--rank` LoRAs on q/k/v/o and the expert gate/up/down projections
(`make_lora_adapter`, seed = adapter index + 1), named `lora-<i>`. Every phase uses greedy
decoding with exactly `--output-len` new tokens per request (`ignore_eos`) and reports medians
over `--repeats` repeats; the runs compared within a repeat are interleaved, their order
rotated per repeat, so load drift on a shared machine hits all of them alike.

1. routing (MoLoRA Table 5/7): for K in `--ks`, `--num-seqs` sequences of `--input-len` tokens
   whose token `t` is drawn from vocabulary range `t % K` (the K ranges split the vocabulary
   evenly, like Chameleon's text/image ranges). Per-token routing serves each sequence as ONE
   request whose `lora_routing` sends every token to its range's adapter (breaks at
   `vocab * k / K`). Per-sequence routing (S-LoRA style) can apply only one adapter to a
   request, so it serves each sequence once per adapter: K requests with `adapter=lora-k`,
   i.e. K x the passes. Both submit all their requests at once (the engine batches them); the
   reported time is the wall time until the last request finishes, `speedup` = per-sequence /
   per-token (the paper's ~K x: 4.1x at K = 4). `passes_*` count requests (forward passes
   over a sequence).
2. overhead: one engine with `max(16, N)` slots holding `max(--num-adapters)` adapters; a fixed
   batch of `--batch-size` requests (same prompts every run) served on the base model and with
   request `i` on adapter `i % N` for N in `--num-adapters`. Reported: TTFT p50 (all requests
   arrive at t = 0), median decode step time (steps after every request has its first token),
   and their ratios to the base run of the same repeat.
3. swap: `--swap-adapters` adapters in host memory, a hot set of S = `--swap-slots` device slots
   (default 2), `--swap-requests` requests whose adapter follows the power-law shares of
   `elasticmoe.bench.esft` (alpha `--swap-alpha`: adapter 0 is the most popular), served in a
   closed loop of `--swap-concurrency` requests in flight (a new one as soon as one finishes).
   Every `engine.step()` is timed; a step "swapped" when `adapters.stats()["swaps_in"]` grew in it.
   Reported per S: swaps in, evictions, hit rate = hits / (hits + misses) (the engine's counts,
   deltas over the run), median step time with and without a swap (and of the no-swap steps that
   finished a prefill: a swap step usually also prefills the request it let in), and total wall time. The
   "on-demand paging" baseline is the same workload on the same kind of engine with S = 1: one
   device slot, so every change of adapter pages the next one in from host memory on the
   critical path (and requests of other adapters wait for the slot); `--swap-slots` may add
   S = number of adapters (all resident, no swaps) as the other bound. `speedup_vs_paging` =
   total time at S = 1 / total time at S. The engine copies adapters into slots on a background
   thread (`LoraSwapper.async_swaps`; a swap then counts in the step that makes it resident);
   `--sync-swaps` copies inside the step instead, so a swap step's time includes the copy.

Progress and tables go to stderr, the JSON document to stdout.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import torch

from elasticmoe.adapters.lora import LoraAdapter
from elasticmoe.bench.common import fmt, ints, logger, median, model_dir, ratio, table
from elasticmoe.bench.engine import percentile
from elasticmoe.bench.workload import power_law_shares
from elasticmoe.config import EngineConfig, ModelConfig, parse_dtype
from elasticmoe.engine.llm_engine import LLMEngine
from elasticmoe.sampling_params import SamplingParams
from elasticmoe.tools.make_lora_adapter import make_lora_adapter

_log = logger("bench.lora")

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
FIRST_ID = 3  # ids 0..2 are pad/bos/eos in our checkpoints








# ---- adapters and engines ---------------------------------------------------------------


def build_adapters(base_dir: str, out_dir: Path, num: int, rank: int) -> list[LoraAdapter]:
    """`num` random LoRAs `lora-<i>` on `base_dir` (reused from `out_dir` when present)."""
    model = ModelConfig.from_pretrained(base_dir)
    adapters = []
    for i in range(num):
        path = out_dir / f"lora-{i}-r{rank}"
        if not (path / "adapter_config.json").exists():
            make_lora_adapter(base_dir, str(path), rank=rank, target_modules=TARGETS, seed=i + 1)
        adapters.append(LoraAdapter.open(f"lora-{i}", str(path), model))
    return adapters


def make_engine(model_dir: str, args: argparse.Namespace, slots: int, adapters: Sequence[LoraAdapter],
                max_cpu_loras: int | None = None) -> LLMEngine:
    engine = LLMEngine(EngineConfig(
        model=model_dir, dtype=parse_dtype(args.dtype), num_threads=args.num_threads, max_loras=slots,
        max_lora_rank=args.rank, max_cpu_loras=max_cpu_loras, seed=args.seed,
        kv_cache_bytes=int(args.kv_cache_gb * (1 << 30)), max_model_len=args.input_len + args.output_len,
        enable_prefix_caching=False,  # the timed runs repeat their prompts: prefill them each time
    ))
    if args.sync_swaps and engine.adapters.swapper is not None:
        engine.adapters.swapper.async_swaps = False  # copy on the engine thread, inside the step
    for a in adapters:
        engine.adapters.load_lora(a.name, a.modules, a.weights, a.config.scaling)
    return engine


# ---- driver -----------------------------------------------------------------------------


Submit = Callable[[LLMEngine, str, list[int]], None]


def drain(engine: LLMEngine, on_finish: Callable[[str], None] | None = None,
          stall_s: float = 30.0) -> dict[str, Any]:
    """Step `engine` until idle. Per step: wall seconds, number of swaps in; per request: first-token time.

    Raises RuntimeError when no step produced a token for `stall_s` seconds (a stuck engine)."""
    step_s: list[float] = []
    step_swaps: list[int] = []
    step_firsts: list[int] = []  # requests that got their first token (finished a prefill) in the step
    first: dict[str, float] = {}
    t0 = last_progress = time.perf_counter()
    while engine.has_unfinished_requests():
        if time.perf_counter() - last_progress > stall_s:
            raise RuntimeError(f"engine made no progress for {stall_s:g}s: {engine.adapters.stats()}")
        swaps = engine.adapters.stats()["swaps_in"]
        t = time.perf_counter()
        outputs = engine.step()
        step_s.append(time.perf_counter() - t)
        step_swaps.append(engine.adapters.stats()["swaps_in"] - swaps)
        step_firsts.append(0)
        if outputs:
            last_progress = time.perf_counter()
        for out in outputs:
            if out.new_token_ids and out.request_id not in first:
                first[out.request_id] = time.perf_counter() - t0
                step_firsts[-1] += 1
            if out.finished and on_finish is not None:
                on_finish(out.request_id)
    return {"wall_s": time.perf_counter() - t0, "step_s": step_s, "step_swaps": step_swaps,
            "step_firsts": step_firsts, "first_s": first}


def _params(args: argparse.Namespace) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)


def _prompt(rng: random.Random, length: int, vocab: int) -> list[int]:
    return [rng.randrange(FIRST_ID, vocab) for _ in range(length)]


# ---- 1. per-token vs per-sequence routing -----------------------------------------------


def interleaved_prompts(num_seqs: int, length: int, vocab: int, k: int, seed: int) -> list[list[int]]:
    """Token `t` of each sequence from range `t % k` of the vocabulary split evenly in k."""
    rng = random.Random(seed)
    bounds = [vocab * i // k for i in range(k + 1)]
    return [[rng.randrange(max(FIRST_ID, bounds[t % k]), bounds[t % k + 1]) for t in range(length)]
            for _ in range(num_seqs)]


def submit_routed(engine: LLMEngine, prompts: list[list[int]], names: list[str], params: SamplingParams,
                  per_token: bool, tag: str) -> int:
    """Queue `prompts` over the K = len(names) vocabulary ranges; returns the passes (requests).

    Per-token: one request per sequence, each token routed to its range's adapter. Per-sequence:
    one request per sequence and adapter, since a request applies a single adapter."""
    vocab = engine.model_config.vocab_size
    k = len(names)
    if per_token:
        routing = {"type": "vocab", "breaks": [vocab * i // k for i in range(1, k)], "adapters": names}
        for j, p in enumerate(prompts):
            engine.add_request(f"{tag}-{j}", p, params, lora_routing=routing)
        return len(prompts)
    for a in names:
        for j, p in enumerate(prompts):
            engine.add_request(f"{tag}-{a}-{j}", p, params, adapter=a)
    return k * len(prompts)


def bench_routing(engine: LLMEngine, names: list[str], args: argparse.Namespace) -> list[dict[str, Any]]:
    vocab = engine.model_config.vocab_size
    params = _params(args)
    rows = []
    for k in args.ks:
        prompts = interleaved_prompts(args.num_seqs, args.input_len, vocab, k, args.seed)
        submit_routed(engine, prompts, names[:k], params, True, f"k{k}-warmup")
        drain(engine)
        walls: dict[str, list[float]] = {"per_token": [], "per_sequence": []}
        passes: dict[str, int] = {}
        for rep in range(args.repeats):
            order = list(walls) if rep % 2 == 0 else list(walls)[::-1]
            for mode in order:
                passes[mode] = submit_routed(engine, prompts, names[:k], params, mode == "per_token",
                                             f"k{k}-r{rep}-{mode}")
                walls[mode].append(drain(engine)["wall_s"])
            _log(f"routing K={k} repeat {rep}: per-token {walls['per_token'][-1]:.2f}s, "
                 f"per-sequence {walls['per_sequence'][-1]:.2f}s")
        rows.append({
            "k": k, "adapters": names[:k], "breaks": [vocab * i // k for i in range(1, k)],
            "num_seqs": len(prompts), "passes_per_token": passes["per_token"],
            "passes_per_sequence": passes["per_sequence"],
            "per_token_s": median(walls["per_token"]), "per_sequence_s": median(walls["per_sequence"]),
            "speedup": median([ratio(s, t) for s, t in zip(walls["per_sequence"], walls["per_token"],
                                                              strict=True)]),
            "per_token_s_runs": walls["per_token"], "per_sequence_s_runs": walls["per_sequence"],
        })
    return rows


# ---- 2. overhead of N adapters vs base ------------------------------------------------


def _batch_metrics(run: dict[str, Any], num_requests: int) -> dict[str, float | None]:
    """TTFT p50 (ms) and the median step time (ms) once every request has its first token."""
    steps, t_all_first = run["step_s"], max(run["first_s"].values())
    elapsed, decode = 0.0, []
    for s in steps:
        elapsed += s
        if elapsed - s >= t_all_first - 1e-9 and len(run["first_s"]) == num_requests:
            decode.append(s * 1e3)
    return {"ttft_ms_p50": percentile([v * 1e3 for v in run["first_s"].values()], 50),
            "decode_step_ms": median(decode), "wall_s": run["wall_s"]}


def bench_overhead(engine: LLMEngine, names: list[str], args: argparse.Namespace) -> list[dict[str, Any]]:
    rng = random.Random(args.seed + 10)
    prompts = [_prompt(rng, args.input_len, engine.model_config.vocab_size) for _ in range(args.batch_size)]
    params = _params(args)
    kinds = [0, *args.num_adapters]  # 0: base

    def run(n: int, tag: str) -> dict[str, float | None]:
        for i, p in enumerate(prompts):
            engine.add_request(f"{tag}-{i}", p, params, adapter=names[i % n] if n else None)
        return _batch_metrics(drain(engine), len(prompts))

    run(max(kinds), "ovh-warmup")
    runs: dict[int, list[dict[str, float | None]]] = {n: [] for n in kinds}
    for rep in range(args.repeats):
        shift = rep % len(kinds)
        for n in kinds[shift:] + kinds[:shift]:
            runs[n].append(run(n, f"ovh-r{rep}-n{n}"))
        _log(f"overhead repeat {rep}: decode step ms " + ", ".join(
            f"N={n}: {runs[n][-1]['decode_step_ms']:.1f}" for n in kinds))
    rows = []
    for n in kinds:
        rows.append({
            "num_adapters": n, "batch_size": len(prompts),
            **{key: median([r[key] for r in runs[n]]) for key in ("ttft_ms_p50", "decode_step_ms", "wall_s")},
            "ttft_ratio": median([ratio(a["ttft_ms_p50"], b["ttft_ms_p50"]) for a, b in zip(runs[n], runs[0],
                                                                                              strict=True)]),
            "decode_step_ratio": median([ratio(a["decode_step_ms"], b["decode_step_ms"])
                                          for a, b in zip(runs[n], runs[0], strict=True)]),
        })
    return rows


# ---- 3. swapping with more adapters than slots ----------------------------------------


def swap_workload(num_requests: int, num_adapters: int, alpha: float, input_len: int, vocab: int,
                  seed: int) -> list[tuple[list[int], int]]:
    """(prompt, adapter index) per request, the adapter drawn with the power-law shares."""
    prompts, choice = random.Random(seed + 20), random.Random(seed + 21)
    shares = power_law_shares(num_adapters, alpha)
    return [(_prompt(prompts, input_len, vocab), choice.choices(range(num_adapters), weights=shares)[0])
            for _ in range(num_requests)]


def run_closed_loop(engine: LLMEngine, workload: Sequence[tuple[list[int], int]], names: list[str],
                    concurrency: int, params: SamplingParams, tag: str) -> dict[str, Any]:
    """Serve `workload` in order with at most `concurrency` requests in flight; swap figures of the run."""
    before = engine.adapters.stats()
    pending = list(enumerate(workload))[::-1]

    def submit_next(_: str | None = None) -> None:
        if pending:
            i, (prompt, a) = pending.pop()
            engine.add_request(f"{tag}-{i}", prompt, params, adapter=names[a])

    for _ in range(concurrency):
        submit_next()
    run = drain(engine, on_finish=submit_next)
    after = engine.adapters.stats()
    delta = {k: after[k] - before[k] for k in ("swaps_in", "evictions", "hits", "misses")}
    swap_ms = [s * 1e3 for s, n in zip(run["step_s"], run["step_swaps"], strict=True) if n > 0]
    other_ms = [s * 1e3 for s, n in zip(run["step_s"], run["step_swaps"], strict=True) if n == 0]
    # A swap step usually also prefills the request it admitted: compare with prefills that needed none.
    prefill_ms = [s * 1e3 for s, n, f in zip(run["step_s"], run["step_swaps"], run["step_firsts"], strict=True)
                  if n == 0 and f > 0]
    return {**delta, "hit_rate": ratio(delta["hits"], delta["hits"] + delta["misses"]),
            "num_steps": len(run["step_s"]), "num_swap_steps": len(swap_ms),
            "swap_step_ms": median(swap_ms), "other_step_ms": median(other_ms),
            "prefill_step_ms": median(prefill_ms), "wall_s": run["wall_s"]}


def bench_swap(model_dir: str, adapters: list[LoraAdapter], args: argparse.Namespace) -> dict[str, Any]:
    names = [a.name for a in adapters]
    vocab = ModelConfig.from_pretrained(model_dir).vocab_size
    workload = swap_workload(args.swap_requests, len(adapters), args.swap_alpha, args.input_len, vocab, args.seed)
    params = _params(args)
    slots = sorted(set(args.swap_slots) | {1})  # S = 1 is the on-demand paging baseline
    engines = {s: make_engine(model_dir, args, s, adapters, max_cpu_loras=len(adapters)) for s in slots}
    for s, engine in engines.items():  # warm-up (untimed): every adapter once
        run_closed_loop(engine, [(workload[0][0], a) for a in range(len(adapters))], names,
                        args.swap_concurrency, params, f"s{s}-warmup")
    runs: dict[int, list[dict[str, Any]]] = {s: [] for s in slots}
    for rep in range(args.repeats):
        shift = rep % len(slots)
        for s in slots[shift:] + slots[:shift]:
            runs[s].append(run_closed_loop(engines[s], workload, names, args.swap_concurrency, params,
                                           f"s{s}-r{rep}"))
        _log(f"swap repeat {rep}: " + ", ".join(
            f"S={s}: {runs[s][-1]['wall_s']:.2f}s, {runs[s][-1]['swaps_in']} swaps" for s in slots))
    swapper = engines[slots[0]].adapters.swapper
    async_swaps = swapper is not None and swapper.async_swaps
    del engines
    gc.collect()
    counts = [0] * len(adapters)
    for _, a in workload:
        counts[a] += 1
    rows = []
    for s in slots:
        keys = ("swaps_in", "evictions", "hits", "misses", "hit_rate", "num_steps", "num_swap_steps",
                "swap_step_ms", "other_step_ms", "prefill_step_ms", "wall_s")
        rows.append({
            "slots": s, "is_paging_baseline": s == 1,
            **{k: median([r[k] for r in runs[s]]) for k in keys},
            "speedup_vs_paging": median([ratio(b["wall_s"], r["wall_s"])
                                          for r, b in zip(runs[s], runs[1], strict=True)]),
        })
    return {"num_adapters": len(adapters), "num_requests": len(workload), "alpha": args.swap_alpha,
            "async_swaps": async_swaps,
            "concurrency": args.swap_concurrency, "requests_per_adapter": counts, "rows": rows}


# ---- report ---------------------------------------------------------------------------






def print_tables(result: dict[str, Any]) -> None:
    out = []
    if result["routing"]:
        out.append(table(
            "per-token vs per-sequence routing, K-range interleaved sequences (medians; speedup = seq / tok)",
            ["K", "seqs", "passes tok", "passes seq", "per-token s", "per-seq s", "speedup"],
            [[str(r["k"]), str(r["num_seqs"]), str(r["passes_per_token"]), str(r["passes_per_sequence"]),
              fmt(r["per_token_s"], ".3f"), fmt(r["per_sequence_s"], ".3f"), fmt(r["speedup"], ".2f")]
             for r in result["routing"]]))
    if result["overhead"]:
        out.append(table(
            "adapter overhead, fixed batch (N = 0: base; ratios to base of the same repeat)",
            ["N", "batch", "TTFT p50 ms", "x", "decode step ms", "x", "wall s"],
            [[str(r["num_adapters"]), str(r["batch_size"]), fmt(r["ttft_ms_p50"], ".1f"), fmt(r["ttft_ratio"], ".3f"),
              fmt(r["decode_step_ms"], ".2f"), fmt(r["decode_step_ratio"], ".3f"), fmt(r["wall_s"], ".2f")]
             for r in result["overhead"]]))
    if result["swap"]:
        sw = result["swap"]
        out.append(table(
            f"hot-set swapping: {sw['num_adapters']} adapters, {sw['num_requests']} requests (alpha "
            f"{sw['alpha']:g}, {sw['concurrency']} in flight); S = 1 is the on-demand paging baseline",
            ["S", "swaps in", "evictions", "hit rate", "swap steps", "swap step ms", "other step ms",
             "prefill no-swap ms", "wall s", "vs paging"],
            [[str(r["slots"]), fmt(r["swaps_in"], ".0f"), fmt(r["evictions"], ".0f"), fmt(r["hit_rate"], ".3f"),
              f"{fmt(r['num_swap_steps'], '.0f')}/{fmt(r['num_steps'], '.0f')}", fmt(r["swap_step_ms"], ".2f"),
              fmt(r["other_step_ms"], ".2f"), fmt(r["prefill_step_ms"], ".2f"), fmt(r["wall_s"], ".2f"),
              fmt(r["speedup_vs_paging"], ".2f")]
             for r in sw["rows"]]))
    print("\n\n".join(out), file=sys.stderr, flush=True)


# ---- main -----------------------------------------------------------------------------




PHASES = {"routing", "overhead", "swap"}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="\n".join(__doc__.splitlines()[4:]))
    p.add_argument("--preset", choices=["tiny", "small"], default="small",
                   help="model size; the model is built under models/ if --model is not given and missing")
    p.add_argument("--model", default=None, help="base checkpoint dir (default: models/<preset>-qwen3-moe)")
    p.add_argument("--adapter-dir", default=None, help="where adapters are written/reused (default: a temp dir)")
    p.add_argument("--rank", type=int, default=8, help="LoRA rank of every adapter (= --max-lora-rank)")
    p.add_argument("--input-len", type=int, default=32, help="prompt tokens per request")
    p.add_argument("--output-len", type=int, default=8, help="new tokens per request")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--ks", type=ints, default=[1, 2, 4], help="routing: comma list of K (adapters / ranges)")
    p.add_argument("--num-seqs", type=int, default=8, help="routing: interleaved sequences per run")
    p.add_argument("--num-adapters", type=ints, default=[1, 4, 16], help="overhead: comma list of N")
    p.add_argument("--batch-size", type=int, default=16, help="overhead: requests in the fixed batch")
    p.add_argument("--swap-adapters", type=int, default=8, help="swap: adapters in host memory")
    p.add_argument("--swap-slots", type=ints, default=[2], help="swap: hot-set sizes S (S = 1 is always added)")
    p.add_argument("--swap-requests", type=int, default=32, help="swap: requests in the workload")
    p.add_argument("--swap-alpha", type=float, default=0.3, help="swap: power-law skew of the adapter choice")
    p.add_argument("--swap-concurrency", type=int, default=4, help="swap: requests in flight")
    p.add_argument("--sync-swaps", action="store_true",
                   help="copy adapters into slots inside the step (default: the engine's, background copies)")
    p.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    p.add_argument("--num-threads", type=int, default=1)
    p.add_argument("--kv-cache-gb", type=float, default=0.25, help="KV pool of each engine")
    p.add_argument("--phases", default="routing,overhead,swap", help="comma list of phases to run")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true", help="print the result as JSON (always on; kept for scripts)")
    args = p.parse_args(argv)
    args.phases = set(args.phases.split(","))
    if args.phases - PHASES:
        p.error(f"--phases: unknown {sorted(args.phases - PHASES)}")
    if min(args.repeats, args.num_seqs, args.batch_size, args.swap_requests, args.swap_concurrency,
           args.input_len, args.output_len, args.rank) < 1:
        p.error("counts and lengths must be >= 1")
    if not args.ks or min(args.ks) < 1 or not args.num_adapters or min(args.num_adapters) < 1:
        p.error("--ks and --num-adapters: non-empty, entries >= 1")
    if not args.swap_slots or min(args.swap_slots) < 1 or args.swap_adapters < 2 or not args.swap_alpha > 0:
        p.error("--swap-slots entries >= 1, --swap-adapters >= 2, --swap-alpha > 0")
    return args




def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    model = model_dir(args, _log)
    started = datetime.now(UTC).isoformat(timespec="seconds")
    load_at_start = os.getloadavg()[0]
    num_needed = max([*args.ks] * ("routing" in args.phases) + [*args.num_adapters] * ("overhead" in args.phases)
                     + [args.swap_adapters] * ("swap" in args.phases))
    routing: list[dict[str, Any]] = []
    overhead: list[dict[str, Any]] = []
    swap: dict[str, Any] | None = None
    with tempfile.TemporaryDirectory(prefix="lora-bench-") as tmp:
        adapters = build_adapters(model, Path(args.adapter_dir or tmp), num_needed, args.rank)
        names = [a.name for a in adapters]
        _log(f"{len(adapters)} rank-{args.rank} adapters on {model}")
        if "routing" in args.phases:
            n = max(args.ks)
            engine = make_engine(model, args, n, adapters[:n])
            routing = bench_routing(engine, names, args)
            del engine
            gc.collect()
        if "overhead" in args.phases:
            n = max(args.num_adapters)
            engine = make_engine(model, args, max(16, n), adapters[:n])
            overhead = bench_overhead(engine, names, args)
            del engine
            gc.collect()
        if "swap" in args.phases:
            swap = bench_swap(model, adapters[: args.swap_adapters], args)
    result: dict[str, Any] = {
        "bench": "lora",
        "started_at": started,
        "model": model,
        "preset": args.preset,
        "dtype": args.dtype,
        "rank": args.rank,
        "target_modules": list(TARGETS),
        "num_threads": torch.get_num_threads(),
        "torch_version": torch.__version__,
        # Other processes on this shared 2-core machine skew timings badly.
        "loadavg_1m_at_start": load_at_start,
        "loadavg_1m_at_end": os.getloadavg()[0],
        "workload": {"input_len": args.input_len, "output_len": args.output_len, "repeats": args.repeats,
                     "seed": args.seed},
        "routing": routing,
        "overhead": overhead,
        "swap": swap,
    }
    print_tables(result)
    print(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
