"""Multi-ESFT serving benchmark (ExpertWeave §5): latency under load, weight memory, rerouting cost.

    python -m elasticmoe.bench.esft [--preset small|tiny] [--model DIR] --num-adapters 5,10,20 --json

Adapters are made from the 4 real ESFT expert configs (DeepSeek-V2-Lite: intent, law,
summary, translation) folded onto the base model (`fit=True`), then replicated under
distinct names as the paper does: adapter `i` is config `i % 4`, named `<config>-<i>`.
`E_max` is the largest experts-per-layer among them.

1. Latency under load (Fig. 5). One seeded workload per run: `--num-requests` random
   prompts of `--input-len` tokens, greedy, exactly `--output-len` new tokens each,
   arriving as a Poisson process of aggregate rate `--rps`. Each request picks an adapter
   with the power-law shares of §5.2 (ExpertWeave follows S-LoRA [34]): adapter `i` of N
   gets share `p_i = ((i + 1) / N)^alpha - (i / N)^alpha`, the mass of the power
   distribution `P(x) = alpha * x^(alpha - 1)` on `[i/N, (i+1)/N)` (S-LoRA draws
   `floor(N * numpy.random.power(alpha))`). alpha = 1 is uniform, smaller alpha is more
   skewed; with N = 2, alpha = 0.32 gives 80/20, the paper's own example. The paper runs
   one Poisson trace of rate `p_i * rps` per adapter; their superposition is one Poisson
   process of rate `rps` whose arrivals pick adapter `i` with probability `p_i`, which is
   what we draw (fixed request count instead of a 100 s horizon). The base-only run
   serves the same prompts at the same arrival times with `adapter=None`, on the same
   engine. An offline driver adds each request once the wall clock passes its arrival
   time and steps the engine: TTFT = first token - arrival, TPOT = (last - first) /
   (n_out - 1). Per repeat, the base-only and adapter runs are interleaved (order rotated
   per repeat); reported: medians over repeats of each run's p50/p90, and the overhead
   ratio = median over repeats of (adapter p50 / base-only p50 of the same repeat).
2. Memory (Fig. 9), per N: see `esft_memory` (ours = mapped 64 KiB pages, padding,
   merged), F_mem, and the KV capacity left in `--device-memory-gb`.
3. Rerouting cost (Fig. 7), at `--tokens` token counts on one MoE block of the largest-N
   engine, every token on a random adapter: the fused gather (`ExpertMap.reroute`), a
   "SingleOp" variant from canonical ops (gather each token's row of Π, then gather its
   top-k from it) and the per-token Python reference (`reroute_naive`), each as a share
   of the block's forward time on the same tokens without rerouting. Medians over
   `--iters` round-robin iterations.

Progress and tables go to stderr, the JSON document to stdout.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import torch

from elasticmoe.adapters.esft import EsftAdapter, EsftConfig
from elasticmoe.adapters.expert_map import ExpertMap, reroute_naive
from elasticmoe.bench.common import floats, fmt, ints, logger, median, model_dir, ratio, table
from elasticmoe.bench.engine import percentile
from elasticmoe.bench.esft_memory import (
    DEVICE_PAGE_SIZE,
    ModelSizes,
    kv_bytes_per_token,
    kv_capacity_tokens,
    weight_memory,
)
from elasticmoe.bench.workload import TimedRequest, make_workload, power_law_shares
from elasticmoe.config import EngineConfig, ModelConfig, parse_dtype
from elasticmoe.engine.kv_cache import KVCacheSpec
from elasticmoe.engine.llm_engine import LLMEngine
from elasticmoe.models.common import ForwardContext, MoEBlock
from elasticmoe.sampling_params import SamplingParams
from elasticmoe.tools.make_esft_adapter import make_esft_adapter

_log = logger("bench.esft")

ESFT_CONFIG_DIR = Path("/work/shared/data/esft_expert_configs")




# ---- runs ---------------------------------------------------------------------------


def run_workload(
    engine: LLMEngine, workload: Sequence[TimedRequest], adapters: Sequence[str] | None, output_len: int, tag: str
) -> dict[str, Any]:
    """Serve `workload` in real time (adapter names, or None for base-only); TTFT/TPOT figures in ms."""
    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    arrival: dict[str, float] = {}
    first: dict[str, float] = {}
    last: dict[str, float] = {}
    num_out: dict[str, int] = {}
    next_index = 0
    t0 = time.perf_counter()
    while next_index < len(workload) or engine.has_unfinished_requests():
        now = time.perf_counter() - t0
        while next_index < len(workload) and workload[next_index].arrival_s <= now:
            req = workload[next_index]
            rid = f"{tag}-{next_index}"
            engine.add_request(rid, req.prompt_token_ids, params,
                               None if adapters is None else adapters[req.adapter_index])
            arrival[rid] = t0 + req.arrival_s
            next_index += 1
        if not engine.has_unfinished_requests():
            time.sleep(max(0.0, workload[next_index].arrival_s - (time.perf_counter() - t0)))
            continue
        outputs = engine.step()
        stamp = time.perf_counter()
        for out in outputs:
            if out.new_token_ids:
                first.setdefault(out.request_id, stamp)
                last[out.request_id] = stamp
            num_out[out.request_id] = len(out.output_token_ids)
    ttft = [(first[r] - arrival[r]) * 1e3 for r in first]
    tpot = [(last[r] - first[r]) / (num_out[r] - 1) * 1e3 for r in first if num_out[r] > 1]
    return {
        "e2e_s": time.perf_counter() - t0,
        "ttft_ms_p50": percentile(ttft, 50),
        "ttft_ms_p90": percentile(ttft, 90),
        "tpot_ms_p50": percentile(tpot, 50),
        "tpot_ms_p90": percentile(tpot, 90),
    }


# ---- adapters -------------------------------------------------------------------------


def build_adapters(base_dir: str, out_dir: Path, dtype: torch.dtype) -> dict[str, EsftAdapter]:
    """The 4 real ESFT configs folded onto `base_dir`, one adapter directory each (config name -> adapter)."""
    model = ModelConfig.from_pretrained(base_dir)
    adapters = {}
    for seed, path in enumerate(sorted(ESFT_CONFIG_DIR.glob("*.json")), start=1):
        adapter_dir = out_dir / path.stem
        if not (adapter_dir / "expert_cfg.json").exists():
            make_esft_adapter(base_dir, adapter_dir, config=EsftConfig.from_file(path), fit=True, seed=seed)
        adapters[path.stem] = EsftAdapter.open(path.stem, adapter_dir, model, dtype)
    if not adapters:
        raise FileNotFoundError(f"no ESFT expert configs in {ESFT_CONFIG_DIR}")
    return adapters


def replicas(adapters: dict[str, EsftAdapter], num_adapters: int) -> list[tuple[str, EsftAdapter]]:
    """Adapter `i` is config `i % len(adapters)`, under the name `<config>-<i>`."""
    configs = list(adapters.items())
    return [(f"{configs[i % len(configs)][0]}-{i}", configs[i % len(configs)][1]) for i in range(num_adapters)]


# ---- phases ---------------------------------------------------------------------------






def bench_latency(engine: LLMEngine, names: list[str], args: argparse.Namespace) -> list[dict[str, Any]]:
    """Base-only and one adapter run per alpha, interleaved, `--repeats` times; one row per alpha."""
    vocab = engine.model_config.vocab_size
    n = len(names)
    shares = {alpha: power_law_shares(n, alpha) for alpha in args.alphas}
    workloads = {alpha: make_workload(args.num_requests, args.rps, shares[alpha], args.input_len, vocab, args.seed)
                 for alpha in args.alphas}
    # Warm-up (untimed): every adapter once, all at t=0, a few tokens.
    warm = [TimedRequest(0.0, r.prompt_token_ids, i % n) for i, r in enumerate(workloads[args.alphas[0]][: 2 * n])]
    run_workload(engine, warm, names, min(4, args.output_len), f"n{n}-warmup")
    kinds: list[float | None] = [None, *args.alphas]  # None: base-only
    runs: dict[float | None, list[dict[str, Any]]] = {k: [] for k in kinds}
    for rep in range(args.repeats):
        shift = rep % len(kinds)
        for kind in kinds[shift:] + kinds[:shift]:
            workload = workloads[args.alphas[0] if kind is None else kind]
            res = run_workload(engine, workload, None if kind is None else names, args.output_len,
                               f"n{n}-r{rep}-{kind}")
            runs[kind].append(res)
            _log(f"N={n} repeat {rep} {_kind_name(kind):>12}: TTFT p50 {res['ttft_ms_p50']:.1f} ms, "
                 f"TPOT p50 {res['tpot_ms_p50']:.2f} ms, e2e {res['e2e_s']:.1f}s")
    keys = ("ttft_ms_p50", "ttft_ms_p90", "tpot_ms_p50", "tpot_ms_p90")
    base = {k: median([r[k] for r in runs[None]]) for k in keys}
    rows = []
    for alpha in args.alphas:
        counts = [0] * n
        for r in workloads[alpha]:
            counts[r.adapter_index] += 1
        row: dict[str, Any] = {
            "num_adapters": n,
            "distribution": _kind_name(alpha),
            "alpha": alpha,
            "expected_top_share": max(shares[alpha]),
            "observed_top_share": max(counts) / len(workloads[alpha]),
            "num_adapters_used": sum(1 for c in counts if c),
            **{k: median([r[k] for r in runs[alpha]]) for k in keys},
            "base": base,
        }
        for metric in ("ttft", "tpot"):
            for q in ("p50", "p90"):
                key = f"{metric}_ms_{q}"
                row[f"{metric}_overhead_{q}"] = median(
                    [ratio(a[key], b[key]) for a, b in zip(runs[alpha], runs[None], strict=True)])
        row["e2e_s_runs"] = [r["e2e_s"] for r in runs[alpha]]
        rows.append(row)
    return rows


def _kind_name(alpha: float | None) -> str:
    if alpha is None:
        return "base-only"
    return "uniform" if alpha == 1 else f"power-{alpha:g}"


def bench_memory(
    model_cfg: ModelConfig, dtype: torch.dtype, adapters: list[tuple[str, EsftAdapter]], e_max: int,
    kv_spec: KVCacheSpec, args: argparse.Namespace,
) -> dict[str, Any]:
    """One memory row (ours / padding / merged, F_mem, KV capacity) for these adapters."""
    sizes = ModelSizes.from_model(model_cfg, torch.tensor([], dtype=dtype).element_size())
    mem = weight_memory(sizes, [a.config.experts for _, a in adapters], e_max, args.page_size)
    budget = int(args.device_memory_gb * (1 << 30))
    per_token = kv_bytes_per_token(kv_spec)
    kv = {scheme: kv_capacity_tokens(budget, nbytes, per_token)
          for scheme, nbytes in (("ours", mem.ours_bytes), ("padding", mem.padding_bytes),
                                 ("merged", mem.merged_bytes), ("base_only", mem.base_bytes))}
    return {
        "num_adapters": mem.num_adapters,
        "e_max": e_max,
        "stored_dtype": str(dtype).removeprefix("torch."),  # the bytes below are of this dtype
        "base_bytes": mem.base_bytes,
        "needed_bytes": mem.needed_bytes,
        "ours_bytes": mem.ours_bytes,
        "padding_bytes": mem.padding_bytes,
        "merged_bytes": mem.merged_bytes,
        "fmem_ours": mem.fmem_ours,
        "fmem_padding": mem.fmem_padding,
        "kv_tokens_ours": kv["ours"],
        "kv_tokens_padding": kv["padding"],
        "kv_tokens_merged": kv["merged"],
        "kv_tokens_base_only": kv["base_only"],
        # None when the merged models leave no room for KV at all (the ratio is unbounded).
        "kv_ratio_ours_vs_merged": ratio(kv["ours"], kv["merged"]),
        "kv_ratio_ours_vs_padding": ratio(kv["ours"], kv["padding"]),
    }


def _rerouted_block(engine: LLMEngine) -> tuple[int, MoEBlock, ExpertMap]:
    """The MoE block whose layer has the most tuned adapter experts."""
    assert engine.adapters.esft is not None
    slots = engine.adapters.esft
    layer = max(slots.maps, key=lambda lyr: int((slots.maps[lyr].pi[1:] >= slots.maps[lyr].num_experts).sum()))
    return layer, slots.blocks[layer], slots.maps[layer]


def _time_round_robin(fns: dict[str, Callable[[], object]], iters: int) -> dict[str, float]:
    """Median microseconds per call of each fn, measured round-robin so drift hits all alike."""
    times: dict[str, list[float]] = {k: [] for k in fns}
    for i in range(iters + max(3, iters // 10)):
        for name, fn in fns.items():
            t = time.perf_counter_ns()
            fn()
            if i >= max(3, iters // 10):  # the first few are warm-up
                times[name].append((time.perf_counter_ns() - t) / 1e3)
    return {k: statistics.median(v) for k, v in times.items()}


def _reroute_row(block: MoEBlock, m: ExpertMap, table: dict[int, dict[int, int]], x: torch.Tensor,
                 aid: torch.Tensor, iters: int) -> dict[str, Any]:
    """Microseconds of each rerouting variant and of the block on tokens `x` [T, H] of adapters `aid` [T]."""
    _, topk_ids, _ = block.route(x)  # [T, k], the real router's choice
    # NOTE: the MoE block never reads ctx.attn.
    base_ctx = ForwardContext(attn=None, token_adapter_ids=None)  # type: ignore[arg-type]
    adapter_ctx = ForwardContext(attn=None, token_adapter_ids=aid)  # type: ignore[arg-type]

    def fused() -> torch.Tensor:
        return m.reroute(topk_ids, aid)

    def single_op() -> torch.Tensor:
        return torch.gather(m.pi.index_select(0, aid + 1), 1, topk_ids)  # each token's row of Π [T, M] -> [T, k]

    def naive() -> torch.Tensor:
        return reroute_naive(topk_ids, aid, table)

    if not (torch.equal(fused(), single_op()) and torch.equal(fused(), naive())):
        raise AssertionError("rerouting variants disagree")
    us = _time_round_robin({
        "fused": fused,
        "singleop": single_op,
        "naive": naive,
        "block": lambda: block(x, base_ctx),
        "block_fused": lambda: block(x, adapter_ctx),
    }, iters)
    row: dict[str, Any] = {"tokens": x.shape[0], **{f"{k}_us": v for k, v in us.items()}}
    for variant in ("fused", "singleop", "naive"):
        row[f"{variant}_share"] = us[variant] / us["block"]
    return row


@torch.inference_mode()
def bench_reroute(engine: LLMEngine, num_adapters: int, args: argparse.Namespace) -> dict[str, Any]:
    layer, block, m = _rerouted_block(engine)
    # reroute_naive's table: slot -> {base expert: virtual id} for the experts the slot replaces.
    table = {a: {e: v for e, v in enumerate(m.pi[a + 1].tolist()) if v != e} for a in range(num_adapters)}
    gen = torch.Generator().manual_seed(args.seed)
    rows = []
    for num_tokens in args.tokens:
        x = torch.randn(num_tokens, engine.model_config.hidden_size, generator=gen).to(engine.config.dtype)
        aid = torch.randint(0, num_adapters, (num_tokens,), generator=gen)
        row = _reroute_row(block, m, table, x, aid, args.iters)
        rows.append(row)
        _log(f"reroute T={num_tokens}: fused {row['fused_us']:.1f} us, singleop {row['singleop_us']:.1f} us, "
             f"naive {row['naive_us']:.1f} us, block {row['block_us']:.0f} us")
    return {"num_adapters": num_adapters, "layer": layer, "iters": args.iters, "rows": rows}


# ---- report ---------------------------------------------------------------------------






def print_tables(result: dict[str, Any]) -> None:
    out = []
    if result["latency"]:
        out.append(table(
            "latency under load (medians over repeats; overhead = adapter p50 / base-only p50)",
            ["N", "dist", "top%", "TTFT p50", "p90", "base p50", "x", "TPOT p50", "p90", "base p50", "x"],
            [[str(r["num_adapters"]), r["distribution"], fmt(100 * r["observed_top_share"], ".0f"),
              fmt(r["ttft_ms_p50"], ".1f"), fmt(r["ttft_ms_p90"], ".1f"), fmt(r["base"]["ttft_ms_p50"], ".1f"),
              fmt(r["ttft_overhead_p50"], ".3f"), fmt(r["tpot_ms_p50"], ".2f"), fmt(r["tpot_ms_p90"], ".2f"),
              fmt(r["base"]["tpot_ms_p50"], ".2f"), fmt(r["tpot_overhead_p50"], ".3f")]
             for r in result["latency"]]))
    if result["memory"]["rows"]:
        mib = 1 << 20
        out.append(table(
            f"weight memory (MiB) and KV capacity (tokens) in {result['memory']['device_memory_gb']:g} GiB",
            ["N", "E_max", "needed", "ours", "padding", "merged", "Fmem ours", "Fmem pad",
             "KV ours", "KV pad", "KV merged", "ours/merged"],
            [[str(r["num_adapters"]), str(r["e_max"]), fmt(r["needed_bytes"] / mib, ".1f"),
              fmt(r["ours_bytes"] / mib, ".1f"), fmt(r["padding_bytes"] / mib, ".1f"),
              fmt(r["merged_bytes"] / mib, ".1f"), fmt(r["fmem_ours"], ".3f"), fmt(r["fmem_padding"], ".3f"),
              str(r["kv_tokens_ours"]), str(r["kv_tokens_padding"]), str(r["kv_tokens_merged"]),
              "inf" if r["kv_ratio_ours_vs_merged"] is None else fmt(r["kv_ratio_ours_vs_merged"], ".2f")]
             for r in result["memory"]["rows"]]))
    if result["reroute"]:
        rr = result["reroute"]
        out.append(table(
            f"rerouting (N={rr['num_adapters']}, layer {rr['layer']}; us, share of the MoE block without it)",
            ["T", "block", "block+fused", "fused", "%", "singleop", "%", "naive", "%"],
            [[str(r["tokens"]), fmt(r["block_us"], ".0f"), fmt(r["block_fused_us"], ".0f"),
              fmt(r["fused_us"], ".1f"), fmt(100 * r["fused_share"], ".2f"), fmt(r["singleop_us"], ".1f"),
              fmt(100 * r["singleop_share"], ".2f"), fmt(r["naive_us"], ".0f"), fmt(100 * r["naive_share"], ".1f")]
             for r in rr["rows"]]))
    print("\n\n".join(out), file=sys.stderr, flush=True)


# ---- main -----------------------------------------------------------------------------






def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", choices=["tiny", "small"], default="small",
                   help="model size; the model is built under models/ if --model is not given and missing")
    p.add_argument("--model", default=None, help="base checkpoint dir (default: models/<preset>-qwen3-moe)")
    p.add_argument("--adapter-dir", default=None, help="where adapters are written/reused (default: a temp dir)")
    p.add_argument("--num-adapters", type=ints, default=[5, 10, 20], help="comma list of N")
    p.add_argument("--alphas", type=floats, default=[1.0, 0.3, 0.1],
                   help="power-law shapes of the adapter choice (1 = uniform)")
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--rps", type=float, default=8.0, help="aggregate Poisson arrival rate (req/s)")
    p.add_argument("--input-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    p.add_argument("--num-threads", type=int, default=2)
    p.add_argument("--kv-cache-gb", type=float, default=0.25, help="KV pool of the latency engines")
    p.add_argument("--device-memory-gb", type=float, default=4.0, help="device budget for the KV capacity figures")
    p.add_argument("--page-size", type=int, default=DEVICE_PAGE_SIZE, help="HMM physical page size (bytes)")
    p.add_argument("--tokens", type=ints, default=[1, 8, 32, 128], help="token counts of the rerouting bench")
    p.add_argument("--iters", type=int, default=200, help="timed iterations per rerouting measurement")
    p.add_argument("--phases", default="latency,memory,reroute", help="comma list of phases to run")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true", help="print the result as JSON (always on; kept for scripts)")
    args = p.parse_args(argv)
    args.phases = set(args.phases.split(","))
    if args.phases - {"latency", "memory", "reroute"}:
        p.error(f"--phases: unknown {sorted(args.phases - {'latency', 'memory', 'reroute'})}")
    if args.repeats < 1 or args.num_requests < 1 or args.iters < 1 or not args.num_adapters:
        p.error("--repeats, --num-requests, --iters must be >= 1 and --num-adapters non-empty")
    if any(n < 1 for n in args.num_adapters) or any(not a > 0 for a in args.alphas) or not args.alphas:
        p.error("--num-adapters entries must be >= 1 and --alphas entries > 0")
    return args




def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    model = model_dir(args, _log)
    dtype = parse_dtype(args.dtype)
    model_cfg = ModelConfig.from_pretrained(model)
    started = datetime.now(UTC).isoformat(timespec="seconds")
    load_at_start = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="esft-bench-") as tmp:
        adapter_root = Path(args.adapter_dir or tmp)
        base_adapters = build_adapters(model, adapter_root, dtype)
        e_max = max(a.config.max_experts_per_layer for a in base_adapters.values())
        _log(f"adapters {sorted(base_adapters)} on {model}: E_max {e_max}")
        latency: list[dict[str, Any]] = []
        memory: list[dict[str, Any]] = []
        reroute: dict[str, Any] | None = None
        kv_per_token: int | None = None
        for i, n in enumerate(args.num_adapters):
            adapters = replicas(base_adapters, n)
            engine = LLMEngine(EngineConfig(
                model=model, dtype=dtype, max_esft_adapters=n, max_esft_experts=e_max,
                num_threads=args.num_threads, kv_cache_bytes=int(args.kv_cache_gb * (1 << 30)),
                max_model_len=args.input_len + args.output_len, seed=args.seed,
                enable_prefix_caching=False,  # the timed runs repeat their prompts: prefill them each time
            ))
            for name, adapter in adapters:
                engine.adapters.load_esft(name, adapter.config.experts, adapter.expert_weights)
            names = [name for name, _ in adapters]
            _log(f"N={n}: engine ready, {len(names)} adapters loaded")
            if "latency" in args.phases:
                latency += bench_latency(engine, names, args)
            kv_per_token = kv_bytes_per_token(engine.kv_spec)
            if "memory" in args.phases:
                # In the dtype the engine holds adapter slots in: a bf16 request is computed (and
                # stored) in fp32 on a host without a fast bf16 GEMM (an AVX2-only CPU).
                row = bench_memory(model_cfg, engine.compute_plan.compute_dtype, adapters, e_max, engine.kv_spec, args)
                assert engine.adapters.esft is not None
                # Cross-check: the engine's bytes of tuned experts = what the arithmetic calls needed.
                row["engine_adapter_bytes"] = sum(engine.adapters.esft.nbytes_of.values())
                memory.append(row)
            if "reroute" in args.phases and i == len(args.num_adapters) - 1:
                reroute = bench_reroute(engine, n, args)
            del engine
            gc.collect()
    result: dict[str, Any] = {
        "bench": "esft",
        "started_at": started,
        "model": model,
        "preset": args.preset,
        "dtype": args.dtype,
        "num_threads": torch.get_num_threads(),
        "torch_version": torch.__version__,
        # Other processes on this shared 2-core machine skew timings badly.
        "loadavg_1m_at_start": load_at_start,
        "loadavg_1m_at_end": os.getloadavg()[0],
        "adapters": {
            "configs": sorted(base_adapters),
            "fit": True,
            "e_max": e_max,
            "experts_per_layer": {k: {str(layer): len(ids) for layer, ids in a.config.experts.items()}
                                  for k, a in sorted(base_adapters.items())},
            "replication": "adapter i = config i % 4, named <config>-<i>",
        },
        "workload": {
            "num_requests": args.num_requests, "rps": args.rps, "input_len": args.input_len,
            "output_len": args.output_len, "repeats": args.repeats, "alphas": args.alphas, "seed": args.seed,
        },
        "latency": latency,
        "memory": {
            "device_memory_gb": args.device_memory_gb,
            "page_size": args.page_size,
            "kv_bytes_per_token": kv_per_token,
            "rows": memory,
        },
        "reroute": reroute,
    }
    print_tables(result)
    print(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
