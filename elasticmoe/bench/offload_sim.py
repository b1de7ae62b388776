"""Expert-offloading simulator (FineMoE §6): replay recorded routing against each policy.

    python -m elasticmoe.bench.offload_sim [--preset small|tiny] [--model DIR] [--trace FILE] --json [--plot FILE]

1. Trace: `--requests` topical prompts of `--prompt-tokens` tokens, each with
   `--new-tokens` sampled decode iterations, recorded from `transformers`' own model on
   the checkpoint (`offload_trace`). Recorded once and kept at `--trace` (default under
   bench-out/); a trace file that exists is reused.
2. Replay (`elasticmoe.offload.replay`): per policy and per cache budget (a fraction of all
   L x E routed experts, at least one layer's E), a fresh policy and an empty cache. The
   first `--history-fraction` of the requests only fill the policies' history and the
   cache (the paper's offline setting: 70% of prompts stored, 30% tested, §6.1); `0` is
   the online setting (empty store, §6.3). The prefetcher completes
   `--prefetch-per-layer` copies per layer (default: top-k, one decode layer's worth;
   0 = no limit).
3. Reported per (policy, budget): hit rate (also prefill / decode), on-demand loads per
   iteration, prefetches used / wasted, bytes moved; FineMoE also its mean similarity
   scores. Tables on stderr, JSON on stdout, `--plot` draws hit rate vs budget.
4. `--domain-shift N`: also the hit rate after a change of traffic. The trace runs N times
   (the past, unmeasured), then the same requests routed to other experts (expert e's routing
   on expert e + E/2: a new domain), measured; once with the cache's visit counts aged
   (`CacheState`: halved every window, the default) and once never aged.

Nothing here is timed: the results are counts and do not depend on machine load.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import torch

from elasticmoe.bench.common import REPO_ROOT, floats, fmt, logger, model_dir, table
from elasticmoe.offload.policy import SEMANTIC_SOURCES, PolicyConfig
from elasticmoe.offload.registry import POLICIES, make_policy
from elasticmoe.offload.replay import ReplayConfig, replay
from elasticmoe.offload.trace import RoutingTrace

_log = logger("bench.offload_sim")

DEFAULT_BUDGETS = [0.125, 0.25, 0.375, 0.5, 0.75]


def budget_capacity(budget: float, num_layers: int, num_experts: int) -> int:
    """Expert slots for a budget given as a fraction of all routed experts; at least one
    layer's worth, since a prefill can route to every expert of a layer."""
    capacity = round(budget * num_layers * num_experts)
    if capacity < num_experts or budget > 1.0:
        raise ValueError(f"budget {budget}: need a fraction in [{num_experts / (num_layers * num_experts):.4g}, 1] "
                         f"(at least one layer's {num_experts} experts)")
    return capacity


def run_policies(trace: RoutingTrace, policies: Sequence[str], budgets: Sequence[float], *, prefetch_distance: int,
                 store_capacity: int, prefetch_per_layer: int | None, batch_size: int, history_fraction: float,
                 semantic: str) -> list[dict[str, Any]]:
    """One result row per (policy, budget), each from a fresh policy and an empty cache."""
    config = PolicyConfig(trace.num_layers, trace.num_experts, trace.top_k, prefetch_distance, store_capacity)
    warmup = int(history_fraction * trace.num_requests)
    rows = []
    for budget in budgets:
        capacity = budget_capacity(budget, trace.num_layers, trace.num_experts)
        for name in policies:
            policy = make_policy(name, config)
            stats = replay(trace, policy, ReplayConfig(capacity, prefetch_per_layer, batch_size, warmup, semantic))
            row: dict[str, Any] = {"policy": name, "budget": budget, "capacity": capacity,
                                   **stats.summary(trace.expert_bytes)}
            search_log = getattr(policy, "search_log", None)
            if search_log is not None:
                row.update(search_log.summary())
            rows.append(row)
            _log(f"{name:>9} budget {budget:.3f} ({capacity} slots): hit rate {fmt(row['hit_rate'], '.3f')}")
    return rows


def run_domain_shift(trace: RoutingTrace, policies: Sequence[str], budgets: Sequence[float], passes: int, *,
                     prefetch_distance: int, store_capacity: int, prefetch_per_layer: int | None, batch_size: int,
                     semantic: str) -> list[dict[str, Any]]:
    """Per (policy, budget): the hit rate over the renumbered trace after `passes` runs of the
    trace, with the visit counts aged (the cache's default) and never aged."""
    config = PolicyConfig(trace.num_layers, trace.num_experts, trace.top_k, prefetch_distance, store_capacity)
    shifted = trace.with_experts_renumbered(torch.roll(torch.arange(trace.num_experts), trace.num_experts // 2))
    rows = []
    for budget in budgets:
        capacity = budget_capacity(budget, trace.num_layers, trace.num_experts)
        for name in policies:
            row: dict[str, Any] = {"policy": name, "budget": budget, "capacity": capacity, "past_passes": passes}
            for label, window in (("aged", None), ("never_aged", 0)):
                replay_config = ReplayConfig(capacity, prefetch_per_layer, batch_size, 0, semantic, window)
                stats = replay(shifted, make_policy(name, config), replay_config, history=[trace] * passes)
                row[f"hit_rate_{label}"] = stats.hit_rate
            rows.append(row)
            _log(f"{name:>9} budget {budget:.3f} after a domain shift: hit rate {fmt(row['hit_rate_aged'], '.3f')} "
                 f"aged, {fmt(row['hit_rate_never_aged'], '.3f')} never aged")
    return rows


def hit_rate_table(rows: list[dict[str, Any]], key: str = "hit_rate") -> tuple[list[str], list[list[str]]]:
    budgets = sorted({r["budget"] for r in rows})
    policies = list(dict.fromkeys(r["policy"] for r in rows))
    cell = {(r["policy"], r["budget"]): r[key] for r in rows}
    header = ["policy", *(f"{b:g}" for b in budgets)]
    return header, [[p, *(fmt(cell.get((p, b)), ".3f") for b in budgets)] for p in policies]


def print_tables(result: dict[str, Any]) -> None:
    rows = result["results"]
    for key, title in (("hit_rate", "expert hit rate by cache budget (fraction of all experts)"),
                       ("decode_hit_rate", "decode-iteration hit rate"),
                       ("on_demand_loads_per_iteration", "on-demand loads per iteration")):
        header, lines = hit_rate_table(rows, key)
        print(table(title, header, lines), file=sys.stderr)
    header = ["policy", "budget", "prefetched", "used", "wasted", "MB moved/iter"]
    lines = [[r["policy"], f"{r['budget']:g}", str(r["prefetch_loads"]), str(r["prefetch_used"]),
              str(r["prefetch_wasted"]), fmt(r["bytes_moved_per_iteration"] and r["bytes_moved_per_iteration"] / 1e6, ".2f")]
             for r in rows]
    print(table("prefetches and traffic", header, lines), file=sys.stderr)
    shift = result.get("domain_shift")
    if shift:
        header = ["policy", "budget", "counts aged", "never aged"]
        lines = [[r["policy"], f"{r['budget']:g}", fmt(r["hit_rate_aged"], ".3f"), fmt(r["hit_rate_never_aged"], ".3f")]
                 for r in shift]
        print(table(f"hit rate after a domain shift ({shift[0]['past_passes']} passes of the trace before)", header,
                    lines), file=sys.stderr)


def plot(result: dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for name in dict.fromkeys(r["policy"] for r in result["results"]):
        rows = sorted((r for r in result["results"] if r["policy"] == name), key=lambda r: r["budget"])
        ax.plot([r["budget"] for r in rows], [r["hit_rate"] for r in rows], marker="o", label=name)
    trace = result["trace"]
    ax.set_xlabel("expert cache budget (fraction of all routed experts)")
    ax.set_ylabel("expert hit rate")
    ax.set_title(f"{trace['model_type']}: L={trace['num_layers']}, E={trace['num_experts']}, k={trace['top_k']}")
    ax.set_ylim(0, 1)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def shown(path: str) -> str:
    """`path` relative to the repository when inside it (results stay comparable across clones)."""
    try:
        return str(Path(path).resolve().relative_to(REPO_ROOT))
    except ValueError:
        return path


def default_trace_path(args: argparse.Namespace) -> Path:
    name = (f"offload-trace-v1-{args.preset if args.model is None else Path(args.model).name}-r{args.requests}"
            f"-p{args.prompt_tokens}-g{args.new_tokens}-t{args.topics}-s{args.seed}.npz")
    return REPO_ROOT / "bench-out" / name


def load_or_record(args: argparse.Namespace) -> tuple[RoutingTrace, str]:
    from elasticmoe.bench.offload_trace import PromptSpec, record_trace

    path = Path(args.trace) if args.trace else default_trace_path(args)
    if path.exists():
        _log(f"trace {path}")
        return RoutingTrace.load(path), str(path)
    model = model_dir(args, _log)
    spec = PromptSpec(args.requests, args.prompt_tokens, args.new_tokens, args.topics, args.topic_share, args.seed)
    _log(f"recording {args.requests} requests on {model} (once; kept at {path})")
    trace = record_trace(model, spec)
    trace.save(path)
    return trace, str(path)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--preset", choices=["tiny", "small"], default="small")
    p.add_argument("--model", default=None, help="checkpoint dir (default: models/<preset>-qwen3-moe)")
    p.add_argument("--trace", default=None, help="trace file: reused if it exists, else recorded there")
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--prompt-tokens", type=int, default=32)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--topics", type=int, default=8, help="prompt topics of the generated corpus")
    p.add_argument("--topic-share", type=float, default=0.8, help="share of a prompt's words from its topic")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--policies", default=",".join(POLICIES), help=f"comma list of {', '.join(POLICIES)}")
    p.add_argument("--budgets", type=floats, default=DEFAULT_BUDGETS, help="cache budgets, fractions of L x E")
    p.add_argument("--prefetch-distance", type=int, default=2, help="d of FineMoE §4.2 (also lfu's)")
    p.add_argument("--store-capacity", type=int, default=1000, help="C of FineMoE §4.4 (also lfu's collection)")
    p.add_argument("--prefetch-per-layer", type=int, default=None,
                   help="copies the prefetcher completes per layer (default: top-k; 0 = no limit)")
    p.add_argument("--batch-size", type=int, default=1, help="requests per iteration")
    p.add_argument("--history-fraction", type=float, default=0.7,
                   help="leading share of requests that only warm the policies (0 = online)")
    p.add_argument("--semantic", choices=SEMANTIC_SOURCES, default="iteration",
                   help="decode iterations' semantic embedding: their own token's (default), or the prompt's")
    p.add_argument("--json", action="store_true", help="print the result as JSON on stdout")
    p.add_argument("--out", default=None, help="also write the JSON here")
    p.add_argument("--plot", default=None, help="PNG of hit rate vs budget per policy")
    p.add_argument("--domain-shift", type=int, default=0, metavar="N",
                   help="also replay a change of traffic: N passes of the trace, then its requests on other "
                        "experts, with and without ageing the visit counts (default 0: not run)")
    args = p.parse_args(argv)
    args.policies = [n for n in args.policies.split(",") if n]
    unknown = [n for n in args.policies if n not in POLICIES]
    if unknown or not args.policies:
        p.error(f"--policies: unknown {unknown}; choose from {', '.join(POLICIES)}")
    if min(args.requests, args.prompt_tokens, args.topics, args.batch_size, args.prefetch_distance,
           args.store_capacity) < 1 or args.new_tokens < 0:
        p.error("counts must be >= 1 (--new-tokens >= 0)")
    if not 0.0 <= args.history_fraction < 1.0:
        p.error("--history-fraction must be in [0, 1)")
    if not args.budgets:
        p.error("--budgets: at least one")
    if args.domain_shift < 0:
        p.error("--domain-shift must be >= 0")
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    # The searches are small matmuls ([1, n*E] x [n*E, C]); with several threads on a busy
    # machine each one waits for the others (measured: 5 ms instead of 50 us).
    torch.set_num_threads(1)
    trace, trace_path = load_or_record(args)
    if args.prefetch_distance > trace.num_layers:
        raise SystemExit(f"--prefetch-distance {args.prefetch_distance} exceeds the {trace.num_layers} layers")
    per_layer = trace.top_k if args.prefetch_per_layer is None else args.prefetch_per_layer
    try:
        rows = run_policies(trace, args.policies, args.budgets, prefetch_distance=args.prefetch_distance,
                            store_capacity=args.store_capacity, prefetch_per_layer=per_layer or None,
                            batch_size=args.batch_size, history_fraction=args.history_fraction,
                            semantic=args.semantic)
        shift = [] if not args.domain_shift else run_domain_shift(
            trace, args.policies, args.budgets, args.domain_shift, prefetch_distance=args.prefetch_distance,
            store_capacity=args.store_capacity, prefetch_per_layer=per_layer or None, batch_size=args.batch_size,
            semantic=args.semantic)
    except ValueError as exc:
        raise SystemExit(str(exc)) from None
    result: dict[str, Any] = {
        "bench": "offload_sim",
        "started_at": datetime.now(UTC).isoformat(timespec="seconds"),
        "trace": {"path": shown(trace_path), "num_layers": trace.num_layers, "num_experts": trace.num_experts,
                  "top_k": trace.top_k, "expert_bytes": trace.expert_bytes, "num_requests": trace.num_requests,
                  "num_iterations": trace.num_iterations,
                  **{k: shown(v) if k == "model" else v for k, v in trace.meta.items() if k != "topics"}},
        "config": {"policies": args.policies, "budgets": args.budgets, "prefetch_distance": args.prefetch_distance,
                   "store_capacity": args.store_capacity, "prefetch_per_layer": per_layer or None,
                   "batch_size": args.batch_size, "history_fraction": args.history_fraction,
                   "semantic": args.semantic, "domain_shift": args.domain_shift},
        "results": rows,
    }
    if shift:
        result["domain_shift"] = shift
    print_tables(result)
    text = json.dumps(result, indent=2)
    if args.out:
        Path(args.out).write_text(text + "\n")
    if args.plot:
        plot(result, args.plot)
        _log(f"plot written to {args.plot}")
    if args.json:
        print(text)
    return result


if __name__ == "__main__":
    main()
