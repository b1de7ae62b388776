"""Offline serving benchmark of the engine: throughput, TTFT and TPOT.

    python -m elasticmoe.bench.engine --model DIR --num-prompts 64 --input-len 128 \\
        --output-len 64 --dtype bfloat16 --json [--profile prof.txt]

Drives `LLMEngine` directly: all requests (random token ids, greedy, exactly
`--output-len` new tokens each) are added at t0, then `step()` runs until none
is left, noting the wall time at which each request gets its first and last
token. TTFT = first - t0; TPOT = (last - first) / (n_out - 1). A short warm-up
run on other prompts comes first (not timed); `--repeats` timed runs follow and
the median one (by output tok/s) is reported, since these machines are shared.
The same workload and definitions are used for vLLM by `scripts/vllm_bench.py`
(see `scripts/bench_vs_vllm.sh`). Progress goes to stderr, the JSON to stdout.

Roofline (`elasticmoe.bench.roofline`, on by default): the run measures this machine's
read bandwidth and bf16/fp32 GEMM peaks (before and after each timed run, the best of each: on a
shared machine a figure measured under load is too low, and fractions above 1 say so), then reports, for the median run, how far the prefill
steps, the decode steps and the whole workload are from their roofline time (the least time
their FLOPs and bytes need at those peaks), with the CPU's ISA and the compute path chosen.
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

import torch

from elasticmoe.bench.roofline import MachinePeaks, ModelCosts, StepWork, measure_machine, phase_fractions
from elasticmoe.config import EngineConfig, parse_engine_dtype
from elasticmoe.engine.llm_engine import LLMEngine
from elasticmoe.sampling_params import SamplingParams
from elasticmoe.utils.gc_heap import freeze_startup_heap


def make_prompt_token_ids(num_prompts: int, input_len: int, vocab_size: int, seed: int,
                          shared_prefix_len: int = 0) -> list[list[int]]:
    """Random prompts; keep identical to `scripts/vllm_bench.py:make_prompt_token_ids`. With
    `shared_prefix_len` every prompt starts with the same that many tokens (a system prompt),
    drawn after the prompts' own."""
    rng = random.Random(seed)
    # Ids 0..2 are pad/bos/eos in our checkpoints; stay clear of them.
    prompts = [[rng.randrange(3, vocab_size) for _ in range(input_len)] for _ in range(num_prompts)]
    shared = [rng.randrange(3, vocab_size) for _ in range(min(shared_prefix_len, input_len))]
    return [shared + p[len(shared) :] for p in prompts]


def percentile(values: list[float], q: int) -> float | None:
    if not values:
        return None
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1]


def _log(msg: str) -> None:
    print(f"[bench.engine] {msg}", file=sys.stderr, flush=True)


class StepRecorder:
    """Notes the work (`StepWork`) of each step the engine executes, for the roofline."""

    def __init__(self, engine: LLMEngine) -> None:
        self.costs = ModelCosts.of(engine.model, engine.kv_pool)
        self.current: StepWork | None = None
        execute = engine.runner.execute

        def recording_execute(sched):
            spans = [(request.num_computed_tokens, n) for request, n in sched.scheduled]
            logits, sample_indices = execute(sched)
            self.current = StepWork.of(self.costs, spans, sum(1 for i in sample_indices if i >= 0))
            return logits, sample_indices

        engine.runner.execute = recording_execute  # type: ignore[method-assign]

    def take(self) -> StepWork | None:
        work, self.current = self.current, None
        return work


def run_batch(engine: LLMEngine, prompts: list[list[int]], output_len: int, tag: str,
              recorder: StepRecorder | None = None) -> dict[str, Any]:
    """Add every prompt at t0, step until done; return throughput and latency figures (and, with a
    `recorder`, each step's work and wall time under "steps")."""
    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    steps: list[tuple[StepWork, float]] = []
    first: dict[str, float] = {}
    last: dict[str, float] = {}
    num_out: dict[str, int] = {}
    num_steps = 0
    t0 = time.perf_counter()
    for i, prompt in enumerate(prompts):
        engine.add_request(f"{tag}-{i}", prompt, params)
    while engine.has_unfinished_requests():
        step_start = time.perf_counter()
        outputs = engine.step()
        now = time.perf_counter()
        num_steps += 1
        work = recorder.take() if recorder is not None else None
        if work is not None:
            steps.append((work, now - step_start))
        for out in outputs:
            if out.new_token_ids:
                first.setdefault(out.request_id, now)
                last[out.request_id] = now
            num_out[out.request_id] = len(out.output_token_ids)
    e2e_s = time.perf_counter() - t0

    total_out = sum(num_out.values())
    total_in = sum(len(p) for p in prompts)
    ttft_ms = [(first[r] - t0) * 1e3 for r in first]
    tpot_ms = [(last[r] - first[r]) / (num_out[r] - 1) * 1e3 for r in first if num_out[r] > 1]
    return {
        "e2e_s": e2e_s,
        "output_tok_s": total_out / e2e_s,
        "total_tok_s": (total_in + total_out) / e2e_s,
        "ttft_ms_p50": percentile(ttft_ms, 50),
        "ttft_ms_p90": percentile(ttft_ms, 90),
        "tpot_ms_p50": percentile(tpot_ms, 50),
        "tpot_ms_p90": percentile(tpot_ms, 90),
        "num_output_tokens": total_out,
        "num_steps": num_steps,
        "steps": steps,
    }


def write_profile(prof: torch.profiler.profile, path: str, row_limit: int = 40) -> None:
    table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=row_limit)
    Path(path).write_text(table + "\n")
    _log(f"profile (top {row_limit} ops by self CPU time) written to {path}")


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="checkpoint directory (config.json + safetensors)")
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--dtype", choices=["bfloat16", "float32", "auto"], default="bfloat16",
                        help="auto: the fastest exact dtype for the checkpoint on this CPU")
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument(
        "--kv-cache-gb", type=float, default=None, help="KV pool size; default: EngineConfig's"
    )
    parser.add_argument("--num-threads", type=int, default=None, help="torch threads; default: torch's")
    parser.add_argument("--shared-prefix-len", type=int, default=0, metavar="N",
                        help="every prompt starts with the same N of its --input-len tokens (default 0)")
    parser.add_argument(
        "--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=False,
        help="the engine's automatic prefix caching (default: off, as scripts/vllm_bench.py runs vLLM; on, the "
        "timed runs after the first find the prompts cached: each run then takes a new seed's prompts)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--warmup",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="one short untimed run on other prompts first (default: on)",
    )
    parser.add_argument("--repeats", type=int, default=3, help="timed runs; the median is reported")
    parser.add_argument(
        "--profile",
        metavar="OUT_TXT",
        default=None,
        help="profile one timed run with torch.profiler (CPU); write the top ops table",
    )
    parser.add_argument(
        "--roofline",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="measure bandwidth and GEMM peaks first; report each phase's fraction of the roofline",
    )
    parser.add_argument(
        "--json", action="store_true", help="print the result as JSON (always on; kept for scripts)"
    )
    args = parser.parse_args(argv)
    if args.repeats < 1:
        parser.error("--repeats must be >= 1")

    load_at_start = os.getloadavg()[0]
    kwargs: dict[str, Any] = {}
    if args.kv_cache_gb is not None:
        kwargs["kv_cache_bytes"] = int(args.kv_cache_gb * (1 << 30))
    config = EngineConfig(
        model=args.model,
        dtype=parse_engine_dtype(args.dtype),
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_num_seqs=args.max_num_seqs,
        max_model_len=args.input_len + args.output_len,
        seed=args.seed,
        num_threads=args.num_threads,
        enable_prefix_caching=args.enable_prefix_caching,
        **kwargs,
    )
    t = time.perf_counter()
    engine = LLMEngine(config)
    load_s = time.perf_counter() - t
    cpu = engine.compute_info()
    _log(f"engine loaded in {load_s:.1f}s ({args.dtype}: computed in {cpu['compute_dtype']}, "
         f"{torch.get_num_threads()} threads, kernels {cpu['expert_kernel']}, bf16 GEMM {cpu['bf16_gemm']})")
    vocab_size = engine.model_config.vocab_size
    peaks: MachinePeaks | None = None
    if args.roofline:
        peaks = measure_machine()
        _log(f"machine: {peaks.isa}, read {peaks.read_gb_s:.1f} GB/s, GEMM bf16 "
             f"{peaks.gemm_gflop_s['bfloat16']:.0f} / fp32 {peaks.gemm_gflop_s['float32']:.0f} GFLOP/s")
    recorder = StepRecorder(engine) if args.roofline else None

    if args.warmup:
        t = time.perf_counter()
        run_batch(
            engine,
            make_prompt_token_ids(args.num_prompts, args.input_len, vocab_size, args.seed + 1),
            min(4, args.output_len),
            "warmup",
        )
        _log(f"warm-up done in {time.perf_counter() - t:.1f}s")
    # As a server does once it is up, and vLLM's engine core at its start (its offline runs too): the
    # collector's full passes walk only what the runs make (elasticmoe.utils.gc_heap)
    freeze_startup_heap("bench.engine")

    def prompts_of(run: int) -> list[list[int]]:
        # With the cache on, a run on the prompts of the run before would find them all cached.
        seed = args.seed + 1000 * (run + 1) if args.enable_prefix_caching else args.seed
        return make_prompt_token_ids(args.num_prompts, args.input_len, vocab_size, seed, args.shared_prefix_len)

    runs = []
    for i in range(args.repeats):
        prompts = prompts_of(i)
        if args.profile and i == 0:
            # NOTE: profiling slows the run; its figures are reported but kept out of the median.
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
                profiled = run_batch(engine, prompts_of(-1), args.output_len, "profiled")
            write_profile(prof, args.profile)
            _log(f"profiled run: {profiled['output_tok_s']:.1f} output tok/s")
        runs.append(run_batch(engine, prompts, args.output_len, f"run{i}", recorder))
        if peaks is not None:  # between runs too: a shared machine is quiet only now and then
            peaks = peaks.best(measure_machine())
        _log(f"timed run {i}: {runs[-1]['output_tok_s']:.1f} output tok/s, e2e {runs[-1]['e2e_s']:.2f}s")
    median = sorted(runs, key=lambda r: r["output_tok_s"])[len(runs) // 2]
    steps = median.pop("steps")
    for run in runs:
        run.pop("steps", None)
    roofline = None
    if peaks is not None:
        roofline = {"machine": {"isa": peaks.isa, "read_gb_s": peaks.read_gb_s, "gemm_gflop_s": peaks.gemm_gflop_s,
                                "num_threads": peaks.num_threads},
                    "phases": phase_fractions(steps, peaks, engine.compute_plan.compute_dtype)}
        phases = roofline["phases"]
        _log("roofline fraction: " + ", ".join(
            f"{name} {p['fraction_of_roofline']:.2f} ({p['measured_s']:.2f}s vs {p['roofline_s']:.2f}s)"
            for name, p in phases.items() if p["measured_s"]))

    result = {
        "engine": "elasticmoe",
        **median,
        "num_prompts": args.num_prompts,
        "input_len": args.input_len,
        "output_len": args.output_len,
        "dtype": args.dtype,
        "num_threads": torch.get_num_threads(),
        "torch_version": torch.__version__,
        "repeats": args.repeats,
        "output_tok_s_runs": [r["output_tok_s"] for r in runs],
        # Other processes on this shared 2-core machine skew timings badly (OpenMP spin-waits).
        "loadavg_1m_at_start": load_at_start,
        "loadavg_1m_at_end": os.getloadavg()[0],
        "load_s": load_s,
        "cpu": cpu,
        "roofline": roofline,
        "settings": {
            "max_num_batched_tokens": config.max_num_batched_tokens,
            "max_num_seqs": config.max_num_seqs,
            "max_model_len": engine.max_model_len,
            "block_size": config.block_size,
            "num_kv_blocks": engine.block_manager.num_blocks,
            "kv_cache_bytes": config.kv_cache_bytes,
            "seed": args.seed,
            "warmup": args.warmup,
            "profile": args.profile,
            "shared_prefix_len": args.shared_prefix_len,
            "enable_prefix_caching": args.enable_prefix_caching,
        },
        "prefix_cache": engine.block_manager.stats(),
    }
    print(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
