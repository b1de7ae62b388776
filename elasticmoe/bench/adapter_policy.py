"""CoServe's adapter policies against their baselines on one engine (CoServe §5.2-5.3 in small):
swaps, evictions and hit rate of the LoRA hot set under a skewed adapter mix.

    python -m elasticmoe.bench.adapter_policy [--preset tiny|small] [--slots 2,4] [--mix zipf|power]

`--adapters` random LoRAs (`elasticmoe.bench.lora.build_adapters`) in host memory, S device slots
for S in `--slots`; `--requests` requests whose adapter follows the mix (Zipf with exponent
`--zipf-s`: adapter i gets a share proportional to 1 / (i + 1)^s; or the power law of
`elasticmoe.bench.workload`), served in a closed loop of `--concurrency` requests in flight, the
same seeded workload for every configuration:

- `coserve`: two-stage eviction with the mix's shares declared as usage probabilities at load
  (what an offline profile of a sample would give) + arranging grouped by adapter;
- `coserve-observed`: the same without declarations: the observed-rate fallback (what the engine
  did before, less its queued-requests term);
- `lru`, `fifo`: Samba-CoE's baselines (eviction), with grouped arranging;
- `samba` : LRU + FCFS arranging (the Samba-CoE system).

Swaps are copied synchronously inside the step (`async_swaps = False`) so the counts do not
depend on when a background copy happens to finish: they are deterministic for a workload. Wall
time is reported but is noisy on a shared machine. Each engine first serves every adapter once
(untimed), identically for every configuration.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
from pathlib import Path
from typing import Any

from elasticmoe.bench.common import fmt, ints, logger, model_dir, table
from elasticmoe.bench.lora import FIRST_ID, TARGETS, build_adapters, run_closed_loop
from elasticmoe.bench.workload import power_law_shares
from elasticmoe.config import EngineConfig, ModelConfig, parse_dtype
from elasticmoe.engine.llm_engine import LLMEngine
from elasticmoe.sampling_params import SamplingParams

_log = logger("bench.adapter_policy")

# name -> (eviction, arranging, declare the shares)
CONFIGS: dict[str, tuple[str, str, bool]] = {
    "coserve": ("coserve", "coserve", True),
    "coserve-observed": ("coserve", "coserve", False),
    "lru": ("lru", "coserve", False),
    "fifo": ("fifo", "coserve", False),
    "samba": ("lru", "fcfs", False),
}


def zipf_shares(num_adapters: int, s: float) -> list[float]:
    """Adapter i's share proportional to 1 / (i + 1)^s (Zipf)."""
    weights = [1.0 / (i + 1) ** s for i in range(num_adapters)]
    return [w / sum(weights) for w in weights]


def make_workload(num_requests: int, shares: list[float], input_len: int, vocab: int,
                  seed: int) -> list[tuple[list[int], int]]:
    """(prompt, adapter index) per request, the adapter drawn with `shares` (seeded)."""
    prompts, choice = random.Random(seed + 20), random.Random(seed + 21)
    return [([prompts.randrange(FIRST_ID, vocab) for _ in range(input_len)],
             choice.choices(range(len(shares)), weights=shares)[0]) for _ in range(num_requests)]


def run(args: argparse.Namespace) -> dict[str, Any]:
    model = model_dir(args, _log)
    vocab = ModelConfig.from_pretrained(model).vocab_size
    shares = zipf_shares(args.adapters, args.zipf_s) if args.mix == "zipf" else power_law_shares(args.adapters,
                                                                                                  args.alpha)
    workload = make_workload(args.requests, shares, args.input_len, vocab, args.seed)
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    rows = []
    with tempfile.TemporaryDirectory(prefix="policy-bench-") as tmp:
        adapters = build_adapters(model, Path(args.adapter_dir or tmp), args.adapters, args.rank)
        names = [a.name for a in adapters]
        for slots in args.slots:
            for config in args.configs:
                eviction, arranging, declare = CONFIGS[config]
                engine = LLMEngine(EngineConfig(
                    model=model, dtype=parse_dtype(args.dtype), num_threads=args.num_threads, max_loras=slots,
                    max_lora_rank=args.rank, max_cpu_loras=len(adapters), seed=args.seed,
                    max_model_len=args.input_len + args.output_len, max_num_seqs=args.max_num_seqs,
                    adapter_eviction=eviction, enable_prefix_caching=False,  # prompts repeat across runs
                    request_arranging=arranging, kv_cache_bytes=64 << 20))
                assert engine.adapters.swapper is not None
                engine.adapters.swapper.async_swaps = False
                for a, share in zip(adapters, shares, strict=True):
                    engine.adapters.load_lora(a.name, a.modules, a.weights, a.config.scaling,
                                              usage_probability=share if declare else None)
                run_closed_loop(engine, [(workload[0][0], i) for i in range(len(adapters))], names,
                                args.concurrency, params, "warmup")
                result = run_closed_loop(engine, workload, names, args.concurrency, params, f"{config}-{slots}")
                rows.append({"slots": slots, "config": config, "eviction": eviction, "arranging": arranging,
                             "declared": declare, **{k: result[k] for k in (
                                 "swaps_in", "evictions", "hits", "misses", "hit_rate", "num_steps", "wall_s")}})
                _log(f"S={slots} {config}: {result['swaps_in']} swaps, hit rate {result['hit_rate']:.3f}, "
                     f"{result['wall_s']:.2f}s")
    return {"bench": "adapter_policy", "model": model, "mix": args.mix, "zipf_s": args.zipf_s, "alpha": args.alpha,
            "shares": shares, "num_adapters": args.adapters, "num_requests": args.requests,
            "concurrency": args.concurrency, "max_num_seqs": args.max_num_seqs, "input_len": args.input_len, "output_len": args.output_len,
            "seed": args.seed, "rows": rows}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="\n".join(__doc__.splitlines()[2:]))
    p.add_argument("--preset", choices=["tiny", "small"], default="tiny")
    p.add_argument("--model", default=None, help="base checkpoint dir (default: models/<preset>-qwen3-moe)")
    p.add_argument("--adapter-dir", default=None, help="where adapters are written/reused (default: a temp dir)")
    p.add_argument("--adapters", type=int, default=8)
    p.add_argument("--slots", type=ints, default=[2, 4])
    p.add_argument("--configs", default=",".join(CONFIGS), help=f"comma list of {sorted(CONFIGS)}")
    p.add_argument("--mix", choices=["zipf", "power"], default="zipf")
    p.add_argument("--zipf-s", type=float, default=1.0)
    p.add_argument("--alpha", type=float, default=0.3, help="power-law skew (--mix power)")
    p.add_argument("--requests", type=int, default=96)
    p.add_argument("--concurrency", type=int, default=4, help="requests in flight (queued or running)")
    p.add_argument("--max-num-seqs", type=int, default=256, help="requests running at once (the batch)")
    p.add_argument("--rank", type=int, default=8)
    p.add_argument("--input-len", type=int, default=16)
    p.add_argument("--output-len", type=int, default=4)
    p.add_argument("--dtype", choices=["bfloat16", "float32"], default="float32")
    p.add_argument("--num-threads", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    args.configs = args.configs.split(",")
    unknown = sorted(set(args.configs) - set(CONFIGS))
    if unknown:
        p.error(f"--configs: unknown {unknown}")
    if args.adapters < 2 or not args.slots or min(args.slots) < 1 or min(args.requests, args.concurrency) < 1:
        p.error("--adapters >= 2, --slots entries >= 1, --requests and --concurrency >= 1")
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    result = run(args)
    print(table(
        f"LoRA hot set, {result['num_adapters']} adapters ({result['mix']} mix), {result['num_requests']} requests, "
        f"{result['concurrency']} in flight (TARGETS {','.join(TARGETS)})",
        ["S", "config", "eviction", "arranging", "swaps in", "evictions", "hit rate", "wall s"],
        [[str(r["slots"]), r["config"], r["eviction"], r["arranging"], str(r["swaps_in"]), str(r["evictions"]),
          fmt(r["hit_rate"], ".3f"), fmt(r["wall_s"], ".2f")] for r in result["rows"]]), file=sys.stderr)
    print(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
