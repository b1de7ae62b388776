"""Expert offloading in the engine (FineMoE §6): hit rate, TTFT and TPOT per policy and budget.

    python -m elasticmoe.bench.offload --model DIR [--json] [--plot offload.png]

Every configuration runs in a fresh engine (`LLMEngine`, this process) over the same prompts:
the held-out prompts of a trained checkpoint (`DIR/heldout_prompts.jsonl`, written by
`python -m elasticmoe.tools.train_model`), else generated ones. A warm-up set of requests runs
first and is not measured: FineMoE's Expert Map Store and LFU's activation matrices learn from
past requests (FineMoE §6.1 does the same with its training split). By default the warm-up fills
a store of 1,000 maps (72 requests of 16 tokens: ~1,150 iterations), the state a serving engine's
store is in within seconds of traffic; a store with room appends where a full one deduplicates.
Then the measured requests run `--batch` at a time (a closed loop: one finishes, the next
starts), greedy, `--max-tokens` each.

Per run: expert hit rate (lookups found resident or being prefetched), on-demand loads,
prefetches useful / wasted, TTFT and TPOT p50 (engine time, no HTTP), the forward thread's time
in the policy (searches, plans) and in on-demand loads, the prefetch thread's copy time.

Paired with the resident engine: the fully resident engine is built once and lives through the
whole bench. Every configuration's measured requests alternate with it, `--batch` at a time, and
its TPOT ratio is to the resident engine's TPOT over those same interleaved requests. This host's
speed drifts by tens of percent within minutes (the same configuration measured 0.8x to 2.4x of a
resident run made a few minutes apart), so only a reference measured within the same seconds makes
a ratio worth reading.

Rounds (`--rounds R`): the resident row and the policy x budget grid run R times, one round after
the other; a row reports the medians over its rounds (TPOT ratio: the median of its rounds' paired
ratios).

Sweeps: every policy at `--budgets` (fractions of the routed experts; Figs. 10 and 12), with the
fully resident engine as the reference; FineMoE's prefetch distance d (Fig. 15) and its map store
capacity C (Fig. 16) at `--sweep-budget`; overheads (Fig. 17) in every run's row.

Transfers (`transfers` in the JSON): one expert's copy into the cache, timed here from each tier
- host memory (a copy), the checkpoint through a warm page cache, the checkpoint after its pages
were dropped (`posix_fadvise(DONTNEED)`, a real disk read) - and, labelled as a model, at a
PCIe-like link rate (`--link-gbps`, default 16 GB/s: PCIe 4.0 x16 in practice), with the stall per
output token that the measured on-demand bytes would cost over such a link.

Misses that read the disk (`--expert-page-cache drop`): the offloading engines drop each expert
read from the OS page cache, so every miss and every prefetch is a disk read, as for a
checkpoint larger than the host's memory; by default (`keep`) a re-read comes from the page
cache, a memory copy. The resident reference is the same either way.
"""

from __future__ import annotations

import argparse
import gc
import itertools
import json
import logging
import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from elasticmoe.config import EXPERT_PAGE_CACHE, EngineConfig
from elasticmoe.engine.llm_engine import LLMEngine
from elasticmoe.offload.policy import SEMANTIC_SOURCES
from elasticmoe.sampling_params import SamplingParams

_log = logging.getLogger("bench.offload")
POLICIES = ("finemoe", "lru", "lfu", "on_demand")


@dataclass
class RunResult:
    policy: str  # "resident": every expert resident (the reference)
    budget: float  # fraction of the routed experts
    prefetch_distance: int
    store_capacity: int
    requests: int
    output_tokens: int
    wall_s: float
    ttft_p50_ms: float
    tpot_p50_ms: float
    cache: dict = field(default_factory=dict)  # the expert cache's counters over the measured part
    # the resident reference's TPOT p50 over the same measured requests, interleaved with these
    paired_resident_tpot_p50_ms: float | None = None
    expert_dtype: str | None = None  # the cache rows' (a bf16 checkpoint computed in fp32 keeps bf16 rows)

    @property
    def hit_rate(self) -> float:
        lookups = self.cache.get("lookups", 0)
        return self.cache["hits"] / lookups if lookups else 1.0


def load_prompts(model_dir: str, count: int) -> list[str]:
    """Held-out prompts of a trained checkpoint, or topical generated ones for any other."""
    path = Path(model_dir) / "heldout_prompts.jsonl"
    if path.is_file():
        prompts = [json.loads(line)["prompt"] for line in path.read_text().splitlines() if line.strip()]
    else:
        _log.warning("%s has no heldout_prompts.jsonl: generated prompts (hit rates of a random model mean little)",
                     model_dir)
        from transformers import AutoTokenizer

        from elasticmoe.bench.offload_trace import PromptSpec, topical_prompts, vocabulary_words

        words = vocabulary_words(AutoTokenizer.from_pretrained(model_dir))
        prompts = [text for _, text in topical_prompts(words, PromptSpec(num_requests=count, prompt_tokens=48))]
    if len(prompts) < count:
        raise ValueError(f"{path}: {len(prompts)} prompts, the bench needs {count} (--warmup + --requests)")
    return prompts[:count]


# Facts about the cache at the end of the run, not counters: kept as they are, not differenced.
_SNAPSHOT_FIELDS = frozenset({"capacity_experts", "expert_bytes", "cache_bytes", "resident_experts"})


def _diff(after: dict, before: dict) -> dict:
    """The cache's counters over the measured part (`after - before`), its snapshot fields as they
    ended, and the hit rate of the measured part."""
    out = {k: round(v - before.get(k, 0), 6) if isinstance(v, (int, float)) and k not in _SNAPSHOT_FIELDS else v
           for k, v in after.items()}
    if "hit_rate" in out:
        out["hit_rate"] = round(out["hits"] / out["lookups"], 4) if out.get("lookups") else 0.0
    return out


def build_engine(args: argparse.Namespace, **offload: Any) -> LLMEngine:
    # 256 MiB of KV cache hold the bench's few requests (the engine's default is 1 GiB).
    return LLMEngine(EngineConfig(model=args.model, dtype=torch.float32 if args.dtype == "float32" else None,
                                  num_threads=args.threads, kv_cache_bytes=256 << 20,
                                  enable_prefix_caching=False,  # rounds repeat the prompts: prefill each time
                                  **offload))


def run_once(args: argparse.Namespace, prompts: list[str], policy: str, budget: float, distance: int,
             capacity: int, reference: LLMEngine) -> RunResult:
    """One configuration over the warm-up, then the measured prompts. `reference` is the fully
    resident engine, alive for the whole bench and warmed: it is the "resident" row, and every
    other configuration's measured requests alternate with it, `--batch` at a time (the first
    chunk on the reference first, the next on the configuration first, ...), so that its TPOT
    ratio compares two engines measured within a second of each other."""
    params = _greedy(args)
    warm, measured = prompts[: args.warmup], prompts[args.warmup:]
    if policy == "resident":
        started = time.perf_counter()
        ttft, tpot, tokens = _drive(reference, measured, params, args.batch)
        return RunResult(policy, budget, distance, capacity, len(measured), tokens,
                         round(time.perf_counter() - started, 3), _p50_ms(ttft), _p50_ms(tpot))
    engine = build_engine(args, expert_cache_fraction=budget, offload_policy=policy,
                          offload_prefetch_distance=distance, offload_store_capacity=capacity,
                          offload_semantic=args.semantic, offload_policy_thread=args.policy_thread,
                          expert_page_cache=args.expert_page_cache)
    assert engine.offload is not None
    expert_dtype = str(engine.offload.cache.w13.dtype).removeprefix("torch.")
    ttft, tpot, paired_tpot, tokens, wall = [], [], [], 0, 0.0
    try:
        _drive(engine, warm, params, args.batch)
        before = engine.offload.stats()
        for index, first in enumerate(range(0, len(measured), args.batch)):
            chunk = measured[first : first + args.batch]
            for side in ((reference, engine) if index % 2 == 0 else (engine, reference)):
                started = time.perf_counter()
                chunk_ttft, chunk_tpot, chunk_tokens = _drive(side, chunk, params, args.batch)
                if side is reference:
                    paired_tpot += chunk_tpot
                    continue
                wall += time.perf_counter() - started
                ttft, tpot, tokens = ttft + chunk_ttft, tpot + chunk_tpot, tokens + chunk_tokens
        cache = _diff(engine.offload.stats(), before)
    finally:
        engine.close()
        del engine
        gc.collect()  # the engine holds reference cycles: free its weights and KV before the next run
    return RunResult(policy, budget, distance, capacity, len(measured), tokens, round(wall, 3), _p50_ms(ttft),
                     _p50_ms(tpot), cache, paired_resident_tpot_p50_ms=_p50_ms(paired_tpot),
                     expert_dtype=expert_dtype)


def _greedy(args: argparse.Namespace) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)


def _p50_ms(seconds: list[float]) -> float:
    return round(1000 * statistics.median(seconds), 2)


def _drive(engine: LLMEngine, prompts: list[str], params: SamplingParams, batch: int) -> tuple[list, list, int]:
    """Run `prompts` with `batch` in flight at once; per request TTFT and TPOT (seconds), and tokens."""
    queue = list(enumerate(prompts))
    added: dict[str, float] = {}
    first: dict[str, float] = {}
    ttft, tpot, tokens = [], [], 0
    while queue or engine.has_unfinished_requests():
        while queue and engine.num_running + engine.num_waiting < batch:
            i, prompt = queue.pop(0)
            engine.add_request(f"r{i}", prompt, params)
            added[f"r{i}"] = time.perf_counter()
        for out in engine.step():
            now = time.perf_counter()
            if out.request_id not in first and out.new_token_ids:
                first[out.request_id] = now
                ttft.append(now - added[out.request_id])
            if out.finished:
                if out.finish_reason == "error":
                    raise RuntimeError(f"request {out.request_id} failed: {out.error}")
                n = len(out.output_token_ids)
                tokens += n
                if n > 1:
                    tpot.append((now - first[out.request_id]) / (n - 1))
    return ttft, tpot, tokens


def measure_transfers(model_dir: str, link_gbps: float, samples: int = 8,
                      dtype: torch.dtype = torch.float32) -> dict:
    """Seconds to copy one expert into a cache row of `dtype` (the engine's: `RunResult.expert_dtype`)
    from each tier (medians of `samples`)."""
    from elasticmoe.config import ModelConfig
    from elasticmoe.engine.expert_sources import DiskExperts, HostExperts
    from elasticmoe.engine.offload_setup import expert_layer_specs
    from elasticmoe.models.registry import model_family

    cfg = ModelConfig.from_pretrained(model_dir)
    specs = model_family(cfg.arch).param_specs(cfg, tuple(range(cfg.num_experts)))
    layers = expert_layer_specs(specs)
    disk = DiskExperts(model_dir, layers)
    w13 = torch.empty(layers[0].w13.shape[1:], dtype=dtype)
    w2 = torch.empty(layers[0].w2.shape[1:], dtype=dtype)
    host_stack = (torch.randn(samples, *w13.shape).to(dtype), torch.randn(samples, *w2.shape).to(dtype))
    host = HostExperts([host_stack])
    files = disk.reader.files

    def timed(fn) -> float:
        times = []
        for i in range(samples):
            started = time.perf_counter()
            fn(i)
            times.append(time.perf_counter() - started)
        return statistics.median(times)

    def drop_page_cache() -> None:
        for path in files:
            fd = os.open(path, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)

    def cold(i: int) -> None:
        disk.copy_into(i % len(layers), i % cfg.num_experts, w13, w2)

    expert_bytes = w13.nbytes + w2.nbytes
    host_s = timed(lambda i: host.copy_into(0, i, w13, w2))
    timed(lambda i: disk.copy_into(i % len(layers), i % cfg.num_experts, w13, w2))  # warm the page cache
    warm_s = timed(lambda i: disk.copy_into(i % len(layers), i % cfg.num_experts, w13, w2))
    cold_times = []
    for i in range(samples):
        drop_page_cache()
        started = time.perf_counter()
        cold(i)
        cold_times.append(time.perf_counter() - started)
    return {"expert_bytes": expert_bytes, "host_copy_s": host_s, "disk_warm_s": warm_s,
            "disk_cold_s": statistics.median(cold_times),
            "model_link_gbps": link_gbps, "model_link_s": expert_bytes / (link_gbps * 1e9)}


def _listed(kind: type[int] | type[float]) -> Callable[[str], list[Any]]:
    """An argparse type: comma-separated numbers of `kind`; empty means none (no sweep)."""
    def parse(text: str) -> list[Any]:
        try:
            return [kind(x) for x in text.split(",") if x.strip()]
        except ValueError:
            raise argparse.ArgumentTypeError(f"comma-separated {kind.__name__}s expected, got {text!r}") from None

    return parse


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m elasticmoe.bench.offload",
                                description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", required=True, metavar="DIR", help="checkpoint (a trained one: see the module doc)")
    p.add_argument("--policies", default=",".join(POLICIES), help="comma-separated (default: all four)")
    p.add_argument("--budgets", type=_listed(float), default="0.1,0.25,0.5,0.75,1.0",
                   help="cache sizes, fractions of the experts")
    p.add_argument("--distances", type=_listed(int), default="1,2,4",
                   help="FineMoE prefetch distances d to sweep (Fig. 15; empty: no sweep)")
    p.add_argument("--capacities", type=_listed(int), default="4,16,64,256",
                   help="FineMoE map store capacities C to sweep (Fig. 16; empty: no sweep)")
    p.add_argument("--policy-thread", action="store_true",
                   help="run the policies' searches and plans on a thread beside the forward (default: on the "
                        "forward thread, each layer's once its experts are resident)")
    p.add_argument("--semantic", choices=SEMANTIC_SOURCES, default=SEMANTIC_SOURCES[0],
                   help="FineMoE's semantic embedding: over the tokens each iteration feeds (default), or the "
                        "prompt's at every iteration")
    p.add_argument("--sweep-budget", type=float, default=0.25, help="cache budget of the d and C sweeps")
    p.add_argument("--warmup", type=int, default=72,
                   help="requests run first, not measured (default 72: at 16 tokens each, enough iterations to\n"
                        "fill a map store of 1,000, as a serving engine's is within seconds)")
    p.add_argument("--requests", type=int, default=16, help="measured requests per run (default 16)")
    p.add_argument("--batch", type=int, default=1, help="requests in flight at once (default 1, as FineMoE)")
    p.add_argument("--max-tokens", type=int, default=16, help="output tokens per request (default 16)")
    p.add_argument("--threads", type=int, default=1,
                   help="torch threads of the engine (default 1: the prefetch thread gets the other core)")
    p.add_argument("--dtype", choices=("float32", "auto"), default="float32")
    p.add_argument("--expert-page-cache", choices=EXPERT_PAGE_CACHE, default="keep",
                   help="the offloading engines' expert reads: keep (the OS page cache keeps what they read:\n"
                   "a miss is a memory copy) or drop (each read's pages dropped: a miss reads the disk,\n"
                   "as for a checkpoint larger than memory; the server's --expert-page-cache)")
    p.add_argument("--link-gbps", type=float, default=16.0, help="modelled host-device link rate, GB/s")
    p.add_argument("--rounds", type=int, default=1,
                   help="runs of the resident reference and the policy x budget grid, one round after the\n"
                        "other; rows report medians, ratios to each round's own resident run (default 1)")
    p.add_argument("--json", action="store_true", help="print the results as JSON")
    p.add_argument("--plot", metavar="FILE", help="write hit rate / TPOT / TTFT / sweep charts (PNG)")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    policies = [x for x in args.policies.split(",") if x]
    unknown = sorted(set(policies) - set(POLICIES))
    if unknown:
        p.error(f"--policies: unknown {unknown}, choose from {', '.join(POLICIES)}")
    budgets = args.budgets
    if not budgets or any(not 0 < b <= 1 for b in budgets):
        p.error("--budgets: fractions in (0, 1]")
    if any(d < 0 for d in args.distances) or any(c < 1 for c in args.capacities):
        p.error("--distances: each >= 0; --capacities: each >= 1")
    if args.rounds < 1:
        p.error("--rounds: at least 1")
    prompts = load_prompts(args.model, args.warmup + args.requests)

    def progress(msg: str) -> None:
        print(f"[offload bench] {msg}", file=sys.stderr, flush=True)

    grid = [("resident", 1.0, 1, 1000)] + [(pol, b, 1, 1000) for pol in policies for b in budgets]
    sweeps = []
    if "finemoe" in policies:
        sweeps += [("finemoe", args.sweep_budget, d, 1000) for d in args.distances if d != 1]
        sweeps += [("finemoe", args.sweep_budget, 1, c) for c in args.capacities if c != 1000]
    total = args.rounds * len(grid) + len(sweeps)
    done = 0

    def run(config: tuple[str, float, int, int]) -> RunResult:
        nonlocal done
        result = run_once(args, prompts, *config, reference=reference)
        done += 1
        policy, budget, distance, capacity = config
        paired = result.paired_resident_tpot_p50_ms
        beside = f" (resident beside it {paired:.1f} ms: {result.tpot_p50_ms / paired:.2f}x)" if paired else ""
        progress(f"{done}/{total} {policy} budget {budget:g} d {distance} C {capacity}: hit rate "
                 f"{result.hit_rate:.3f}, TTFT p50 {result.ttft_p50_ms:.1f} ms, TPOT p50 {result.tpot_p50_ms:.1f} ms"
                 + beside)
        return result

    # The resident reference lives through the whole bench (see run_once): this host's speed drifts
    # by tens of percent within minutes, and a configuration's TPOT is compared with the reference's
    # over the same interleaved requests. Each round runs the reference alone first (its own row).
    reference = build_engine(args)
    try:
        _drive(reference, prompts[: args.warmup], _greedy(args), args.batch)
        rounds = [[run(config) for config in grid] for _ in range(args.rounds)]
        sweep_runs = [run(config) for config in sweeps]  # hit rates: one round is enough
    finally:
        reference.close()
    resident_tpot = statistics.median(r[0].tpot_p50_ms for r in rounds)
    rows = [_merged([r[i] for r in rounds]) for i in range(len(grid))]
    rows += [_merged([result]) for result in sweep_runs]
    # the rows the runs' caches held (their dtype is the engine's choice: `LLMEngine._expert_dtype`)
    dtypes = {r.expert_dtype for r in [*itertools.chain(*rounds), *sweep_runs] if r.expert_dtype is not None}
    row_dtype = getattr(torch, dtypes.pop()) if len(dtypes) == 1 else torch.float32
    transfers = measure_transfers(args.model, args.link_gbps, dtype=row_dtype)
    for row in rows[1:]:
        ondemand_bytes = row["cache"].get("on_demand_loads", 0) * transfers["expert_bytes"]
        row["cache"]["model_link_stall_per_token_ms"] = round(
            1000 * ondemand_bytes / (args.link_gbps * 1e9) / max(row["output_tokens"], 1), 3)
    report = {
        "bench": "offload", "model": args.model, "batch": args.batch, "max_tokens": args.max_tokens,
        "semantic": args.semantic, "policy_thread": args.policy_thread, "warmup": args.warmup,
        "requests": args.requests, "threads": args.threads, "rounds": args.rounds,
        "expert_page_cache": args.expert_page_cache,
        "resident_tpot_p50_ms": resident_tpot, "transfers": transfers, "runs": rows,
    }
    if args.plot:
        _plot(report, args.plot, policies, args.sweep_budget)
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        for row in report["runs"]:
            print(f"{row['policy']:>9} budget {row['budget']:<5g} d {row['prefetch_distance']} "
                  f"C {row['store_capacity']:<4} hit {row['hit_rate']:.3f} TTFT {row['ttft_p50_ms']:.1f} ms "
                  f"TPOT {row['tpot_p50_ms']:.1f} ms ({row['tpot_vs_resident']:.2f}x resident)")
    return 0


def _merged(runs: list[RunResult]) -> dict[str, Any]:
    """One configuration's row from its runs (one per round): the medians of TTFT, TPOT and of the
    per-round ratios of its TPOT to the resident reference's over the same interleaved requests (the
    resident row's: 1); the counters of the first run."""
    row = {**asdict(runs[0]), "hit_rate": round(statistics.median(r.hit_rate for r in runs), 4)}
    ratios = [r.tpot_p50_ms / (r.paired_resident_tpot_p50_ms or r.tpot_p50_ms) for r in runs]
    row.update(ttft_p50_ms=round(statistics.median(r.ttft_p50_ms for r in runs), 2),
               tpot_p50_ms=round(statistics.median(r.tpot_p50_ms for r in runs), 2),
               tpot_vs_resident=round(statistics.median(ratios), 3),
               rounds_tpot_p50_ms=[r.tpot_p50_ms for r in runs], rounds_tpot_vs_resident=[round(x, 3) for x in ratios],
               rounds_paired_resident_tpot_p50_ms=[r.paired_resident_tpot_p50_ms for r in runs])
    return row


def _plot(report: dict, path: str, policies: list[str], sweep_budget: float) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = report["runs"]
    main_runs = [r for r in runs if r["prefetch_distance"] == 1 and r["store_capacity"] == 1000]
    fig, axes = plt.subplots(2, 2, figsize=(11, 8))
    for key, ax, label in (("hit_rate", axes[0][0], "expert hit rate"), ("tpot_p50_ms", axes[0][1], "TPOT p50 (ms)"),
                           ("ttft_p50_ms", axes[1][0], "TTFT p50 (ms)")):
        for policy in policies:
            rows = sorted((r for r in main_runs if r["policy"] == policy), key=lambda r: r["budget"])
            ax.plot([r["budget"] for r in rows], [r[key] for r in rows], marker="o", label=policy)
        if key != "hit_rate":
            ax.axhline(main_runs[0][key], color="grey", linestyle="--", label="resident")
        ax.set_xlabel("cache budget (fraction of experts)")
        ax.set_ylabel(label)
        ax.legend()
    ax = axes[1][1]
    for field_name, label in (("prefetch_distance", "d"), ("store_capacity", "C")):
        other = "store_capacity" if field_name == "prefetch_distance" else "prefetch_distance"
        default = 1000 if other == "store_capacity" else 1
        rows = sorted((r for r in runs if r["policy"] == "finemoe" and r["budget"] == sweep_budget
                       and r[other] == default), key=lambda r: r[field_name])
        ax.plot(range(len(rows)), [r["hit_rate"] for r in rows], marker="o",
                label=f"{label}: " + ", ".join(str(r[field_name]) for r in rows))
    ax.set_title(f"FineMoE sweeps at budget {sweep_budget:g}")
    ax.set_ylabel("expert hit rate")
    ax.set_xlabel("sweep point")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)


if __name__ == "__main__":
    sys.exit(main())
