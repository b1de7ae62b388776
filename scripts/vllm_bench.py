"""vLLM side of the ElasticMoE-vs-vLLM offline throughput benchmark.

Runs in its own venv (`.venv-vllm`, made by `scripts/bench_vs_vllm.sh`): vLLM
pins its own torch/transformers/numpy and is never a dependency of the project.

    python scripts/vllm_bench.py run --model DIR --dtype bfloat16 > vllm.json
    python scripts/vllm_bench.py compare --vllm a.json b.json --ours c.json d.json

`run` executes vLLM in-process (VLLM_ENABLE_V1_MULTIPROCESSING=0): one warm-up
generate on different random prompts, then one timed generate of
`--num-prompts` prompts of `--input-len` random token ids each, greedy, exactly
`--output-len` new tokens each (ignore_eos). TTFT and TPOT come from vLLM's
per-request stats (RequestOutput.metrics, needs disable_log_stats=False), with
the same definitions as `elasticmoe.bench.engine`: TTFT = first token time - t0
(t0 = just before `generate`), TPOT = (last - first) / (n_out - 1).

`compare` needs only the standard library and merges the per-dtype JSON files
into one object with ours/vLLM ratios.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

GiB = 1 << 30


def make_prompt_token_ids(num_prompts: int, input_len: int, vocab_size: int, seed: int) -> list[list[int]]:
    """Random prompts; keep identical to `elasticmoe.bench.engine.make_prompt_token_ids`."""
    rng = random.Random(seed)
    # Ids 0..2 are pad/bos/eos in our checkpoints; stay clear of them.
    return [[rng.randrange(3, vocab_size) for _ in range(input_len)] for _ in range(num_prompts)]


def _percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=100, method="inclusive")[int(q) - 1]


def _log(msg: str) -> None:
    print(f"[vllm_bench] {msg}", file=sys.stderr, flush=True)


def _timed_generate(llm: Any, prompts: list[Any], params: Any) -> dict[str, Any]:
    t0_wall = time.time()
    t0 = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    e2e_s = time.perf_counter() - t0
    num_out = sum(len(o.outputs[0].token_ids) for o in outputs)
    num_in = sum(len(o.prompt_token_ids or []) for o in outputs)
    ttft_ms: list[float] = []
    tpot_ms: list[float] = []
    for o in outputs:
        m, n = o.metrics, len(o.outputs[0].token_ids)
        if m is None or not m.first_token_ts:
            continue
        # arrival_time is wall clock and first_token_latency is measured from
        # it; first/last_token_ts share the engine core's monotonic clock.
        ttft_ms.append((m.arrival_time + m.first_token_latency - t0_wall) * 1e3)
        if n > 1:
            tpot_ms.append((m.last_token_ts - m.first_token_ts) / (n - 1) * 1e3)
    return {
        "e2e_s": e2e_s,
        "output_tok_s": num_out / e2e_s,
        "total_tok_s": (num_in + num_out) / e2e_s,
        "ttft_ms_p50": _percentile(ttft_ms, 50),
        "ttft_ms_p90": _percentile(ttft_ms, 90),
        "tpot_ms_p50": _percentile(tpot_ms, 50),
        "tpot_ms_p90": _percentile(tpot_ms, 90),
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    # NOTE: must be set before vllm is imported; in-process engine core, no
    # busy-polling client/engine process pair fighting over 2 cores.
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(args.kv_cache_gb)
    # vLLM's serving setup tries to drop torch to 1 thread unless OMP_NUM_THREADS
    # is set (in-process its CPU worker happens to block that): pin it to the
    # cores we may use. libgomp reads it when torch loads, so before the import.
    os.environ.setdefault("OMP_NUM_THREADS", str(len(os.sched_getaffinity(0))))
    load_at_start = os.getloadavg()[0]
    import torch
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    config = json.loads((Path(args.model) / "config.json").read_text())
    vocab_size = int(config["vocab_size"])
    max_model_len = args.input_len + args.output_len
    llm_kwargs: dict[str, Any] = dict(
        model=args.model,
        dtype=args.dtype,
        seed=args.seed,
        max_model_len=max_model_len,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        enable_prefix_caching=False,  # random prompts never share a prefix anyway
        enforce_eager=args.enforce_eager,
        disable_log_stats=False,  # fills RequestOutput.metrics (TTFT/TPOT)
        tensor_parallel_size=1,
    )
    _log(f"vllm {vllm.__version__} torch {torch.__version__}: LLM({llm_kwargs})")
    t_load = time.perf_counter()
    llm = LLM(**llm_kwargs)
    load_s = time.perf_counter() - t_load
    cache = llm.llm_engine.vllm_config.cache_config
    compilation = llm.llm_engine.vllm_config.compilation_config
    _log(f"loaded in {load_s:.1f}s")

    def prompts(seed: int) -> list[TokensPrompt]:
        ids = make_prompt_token_ids(args.num_prompts, args.input_len, vocab_size, seed)
        return [TokensPrompt(prompt_token_ids=p) for p in ids]

    warmup_params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    t = time.perf_counter()
    llm.generate(prompts(args.seed + 1), warmup_params, use_tqdm=False)
    _log(f"warm-up done in {time.perf_counter() - t:.1f}s")

    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    timed_prompts = prompts(args.seed)
    runs = [_timed_generate(llm, timed_prompts, params) for _ in range(args.repeats)]
    for i, r in enumerate(runs):
        _log(f"timed run {i}: {r['output_tok_s']:.1f} output tok/s, e2e {r['e2e_s']:.2f}s")
    # The machine is shared and noisy: report the median run (by throughput).
    median = sorted(runs, key=lambda r: r["output_tok_s"])[len(runs) // 2]

    return {
        "engine": "vllm",
        "vllm_version": vllm.__version__,
        "torch_version": torch.__version__,
        "dtype": args.dtype,
        "num_prompts": args.num_prompts,
        "input_len": args.input_len,
        "output_len": args.output_len,
        "num_threads": torch.get_num_threads(),
        **median,
        "repeats": args.repeats,
        "output_tok_s_runs": [r["output_tok_s"] for r in runs],
        # Other processes on this shared 2-core machine skew timings badly (OpenMP spin-waits).
        "loadavg_1m_at_start": load_at_start,
        "loadavg_1m_at_end": os.getloadavg()[0],
        "load_s": load_s,
        "settings": {
            **{k: v for k, v in llm_kwargs.items() if k != "model"},
            "kv_cache_bytes": cache.kv_cache_memory_bytes,
            "block_size": cache.block_size,
            "num_gpu_blocks": cache.num_gpu_blocks,
            "compilation_mode": str(compilation.mode),
            "compilation_backend": compilation.backend,
            "env": {
                k: os.environ.get(k)
                for k in (
                    "VLLM_ENABLE_V1_MULTIPROCESSING",
                    "VLLM_CPU_KVCACHE_SPACE",
                    "VLLM_CPU_OMP_THREADS_BIND",
                    "OMP_NUM_THREADS",
                    "LD_PRELOAD",
                )
            },
        },
    }


def compare(args: argparse.Namespace) -> dict[str, Any]:
    def load(paths: list[str]) -> dict[str, dict[str, Any]]:
        results = [json.loads(Path(p).read_text()) for p in paths]
        return {r["dtype"]: r for r in results}

    vllm_by_dtype, ours_by_dtype = load(args.vllm), load(args.ours)
    out: dict[str, Any] = {"model": args.model, "results": {}}
    for dtype in sorted(set(vllm_by_dtype) | set(ours_by_dtype)):
        v, o = vllm_by_dtype.get(dtype), ours_by_dtype.get(dtype)
        entry: dict[str, Any] = {"ours": o, "vllm": v, "ratio_ours_over_vllm": None}
        if v and o:
            entry["ratio_ours_over_vllm"] = {
                k: o[k] / v[k] for k in ("output_tok_s", "total_tok_s") if v.get(k)
            }
        out["results"][dtype] = entry
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="benchmark vLLM offline on one dtype; JSON to stdout")
    r.add_argument("--model", required=True)
    r.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    r.add_argument("--num-prompts", type=int, default=64)
    r.add_argument("--input-len", type=int, default=128)
    r.add_argument("--output-len", type=int, default=64)
    r.add_argument("--seed", type=int, default=0)
    r.add_argument("--kv-cache-gb", type=int, default=4)
    r.add_argument("--max-num-seqs", type=int, default=64)
    r.add_argument("--max-num-batched-tokens", type=int, default=2048)
    r.add_argument("--enforce-eager", action="store_true")
    r.add_argument("--repeats", type=int, default=3, help="timed runs; the median is reported")
    c = sub.add_parser("compare", help="merge per-dtype JSON files; ours/vLLM ratios")
    c.add_argument("--model", default=None)
    c.add_argument("--vllm", nargs="*", default=[], help="vllm_bench.py run outputs")
    c.add_argument("--ours", nargs="*", default=[], help="python -m elasticmoe.bench.engine outputs")
    args = parser.parse_args()
    if args.cmd == "compare":
        print(json.dumps(compare(args), indent=2))
        return
    # NOTE: vLLM (and inductor's compiler calls) write logs to fd 1; keep
    # stdout for the JSON only by pointing fd 1 at stderr during the run.
    sys.stdout.flush()
    json_out = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
    result = run(args)
    print(json.dumps(result, indent=2), file=json_out, flush=True)


if __name__ == "__main__":
    main()
