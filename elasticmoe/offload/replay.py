"""Trace-driven simulation: replay a `RoutingTrace` against a policy and an expert cache,
calling the policy exactly as an engine would (see `policy`), and count what happens.

Timing model (what "in time" means without a clock):
- Before layer 0 and after each layer's router, the policy's plan goes to the prefetcher,
  which completes up to `prefetch_per_layer` copies before the next layer's router runs
  (the copies overlap that layer's expert GEMM and the next attention). None: no limit.
- A routed expert that is resident when its layer's router has run is a hit; otherwise a
  miss, loaded on demand before the GEMM (FineMoE §3.2 step 4). On-demand loads do not
  use the prefetch budget: the forward waits for them instead (§4.5 pauses prefetching).
- Hits and misses count (iteration, layer, expert) once each, as R^(i)_{l,j} of §3.3.

Requests run in fixed batches of `batch_size` in trace order (iteration t of a batch holds
the t-th iteration of each of its requests that has one). The first `warmup_requests`
requests only warm the policy's statistics and the cache (FineMoE §6.1 fills its store
with 70% of the prompts and tests on the rest); counters cover the others.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch

from elasticmoe.offload.cache_ops import CacheUpdate, load_on_demand, routed_experts, run_prefetch
from elasticmoe.offload.cache_state import CacheState, ExpertKey
from elasticmoe.offload.policy import SEMANTIC_SOURCES, OffloadPolicy, RequestContext
from elasticmoe.offload.trace import RoutingTrace


@dataclass(frozen=True, slots=True)
class ReplayConfig:
    """`capacity` expert slots; `semantic`: which embedding a request presents at decode
    iterations, the mean over the iteration's own token ("iteration", see `RequestContext`) or
    its prompt's ("prompt"). At prefill both are the prompt's."""

    capacity: int
    prefetch_per_layer: int | None = None
    batch_size: int = 1
    warmup_requests: int = 0
    semantic: str = "iteration"
    ageing_window: int | None = None  # visits between halvings of the counts (`CacheState.empty`)

    def __post_init__(self) -> None:
        if self.capacity < 1 or self.batch_size < 1 or self.warmup_requests < 0:
            raise ValueError(f"replay: need capacity >= 1, batch_size >= 1, warmup_requests >= 0, got {self}")
        if self.prefetch_per_layer is not None and self.prefetch_per_layer < 0:
            raise ValueError(f"replay: prefetch_per_layer must be >= 0 or None, got {self.prefetch_per_layer}")
        if self.semantic not in SEMANTIC_SOURCES:
            raise ValueError(f"replay: semantic must be one of {SEMANTIC_SOURCES}, got {self.semantic!r}")


@dataclass(slots=True)
class ReplayStats:
    """Counts over the measured requests. `prefetch_used` + `prefetch_wasted` =
    `prefetch_loads`: a prefetched expert is used if it is hit before it leaves the cache,
    wasted if evicted first or still unused at the end."""

    num_iterations: int = 0
    num_prefill_iterations: int = 0
    hits: int = 0
    misses: int = 0  # = on-demand loads
    prefill_hits: int = 0
    prefill_misses: int = 0
    prefetch_loads: int = 0
    prefetch_used: int = 0
    prefetch_wasted: int = 0
    evictions: int = 0

    @property
    def hit_rate(self) -> float | None:
        total = self.hits + self.misses
        return self.hits / total if total else None

    def summary(self, expert_bytes: int) -> dict[str, Any]:
        decode_hits, decode_misses = self.hits - self.prefill_hits, self.misses - self.prefill_misses
        loads = self.misses + self.prefetch_loads
        return {
            **asdict(self),
            "hit_rate": self.hit_rate,
            "prefill_hit_rate": _ratio(self.prefill_hits, self.prefill_hits + self.prefill_misses),
            "decode_hit_rate": _ratio(decode_hits, decode_hits + decode_misses),
            "on_demand_loads_per_iteration": _ratio(self.misses, self.num_iterations),
            "prefetch_accuracy": _ratio(self.prefetch_used, self.prefetch_loads),
            "bytes_moved": loads * expert_bytes,
            "bytes_moved_per_iteration": _ratio(loads * expert_bytes, self.num_iterations),
        }


def _ratio(a: int, b: int) -> float | None:
    return a / b if b else None


class _Counter:
    """Counts into `stats` while `measuring`; tracks prefetched experts not used yet."""

    def __init__(self, stats: ReplayStats) -> None:
        self.stats = stats
        self.measuring = False
        self.unused_prefetches: set[ExpertKey] = set()

    def start_measuring(self) -> None:
        self.measuring = True
        self.unused_prefetches.clear()

    def finish(self) -> None:
        self.stats.prefetch_wasted += len(self.unused_prefetches)
        self.unused_prefetches.clear()

    def evicted(self, keys: Sequence[ExpertKey]) -> None:
        if not self.measuring:
            return
        self.stats.evictions += len(keys)
        for key in keys:
            if key in self.unused_prefetches:
                self.unused_prefetches.discard(key)
                self.stats.prefetch_wasted += 1

    def prefetched(self, update: CacheUpdate) -> None:
        self.evicted(update.evicted)
        if self.measuring:
            self.stats.prefetch_loads += len(update.loaded)
            self.unused_prefetches.update(update.loaded)

    def routed(self, cache: CacheState, layer: int, needed: Sequence[int], is_prefill: bool) -> None:
        if not self.measuring:
            return
        num_hits = 0
        for expert in needed:
            if cache.resident[layer, expert]:
                num_hits += 1
                if (layer, expert) in self.unused_prefetches:
                    self.unused_prefetches.discard((layer, expert))
                    self.stats.prefetch_used += 1
        num_misses = len(needed) - num_hits
        self.stats.hits += num_hits
        self.stats.misses += num_misses
        if is_prefill:
            self.stats.prefill_hits += num_hits
            self.stats.prefill_misses += num_misses


def replay(trace: RoutingTrace, policy: OffloadPolicy, config: ReplayConfig,
           history: Sequence[RoutingTrace] = ()) -> ReplayStats:
    """Run every request of `trace` through `policy` with a cache of `config.capacity` slots.
    `history`: traces of the same model run first, unmeasured, through the same policy and cache
    (the past the measured traffic follows: another domain's requests, say)."""
    counter = _Counter(ReplayStats())
    cache = CacheState.empty(trace.num_layers, trace.num_experts, config.capacity, config.ageing_window)
    for past in history:
        if (past.num_layers, past.num_experts) != (trace.num_layers, trace.num_experts):
            raise ValueError("replay: a history trace of another model shape")
        for start in range(0, past.num_requests, config.batch_size):
            batch = list(range(start, min(start + config.batch_size, past.num_requests)))
            cache = _replay_batch(past, policy, config, cache, batch, counter)
    warmup = min(config.warmup_requests, trace.num_requests)
    for first, last, measuring in ((0, warmup, False), (warmup, trace.num_requests, True)):
        if measuring:
            counter.start_measuring()
        for start in range(first, last, config.batch_size):
            batch = list(range(start, min(start + config.batch_size, last)))
            cache = _replay_batch(trace, policy, config, cache, batch, counter)
    counter.finish()
    return counter.stats


def _replay_batch(trace: RoutingTrace, policy: OffloadPolicy, config: ReplayConfig, cache: CacheState,
                  batch: list[int], counter: _Counter) -> CacheState:
    iterations = [trace.iterations_of(r) for r in batch]
    for step in range(max(len(its) for its in iterations)):
        active = [(r, its[step]) for r, its in zip(batch, iterations, strict=True) if step < len(its)]
        finished = [str(r) for r, its in zip(batch, iterations, strict=True) if step == len(its) - 1]
        cache = _replay_iteration(trace, policy, config, cache, active, finished, step == 0, counter)
    return cache


def _replay_iteration(trace: RoutingTrace, policy: OffloadPolicy, config: ReplayConfig, cache: CacheState,
                      active: list[tuple[int, int]], finished: Collection[str], is_prefill: bool,
                      counter: _Counter) -> CacheState:
    contexts = [RequestContext(str(r), int(trace.iteration_num_tokens[i]), _embedding(trace, config, r, i),
                               is_prefill) for r, i in active]
    slices = [trace.token_slice(i) for _, i in active]

    def rows(t: torch.Tensor) -> torch.Tensor:  # this iteration's tokens, batch order
        return t[slices[0]] if len(slices) == 1 else torch.cat([t[s] for s in slices])

    gate_probs, topk_ids = rows(trace.gate_probs), rows(trace.topk_ids)  # [T, L, E], [T, L, k]
    next_probs = None
    if policy.needs_next_layer_gate and trace.next_gate_probs is not None:
        next_probs = rows(trace.next_gate_probs)
    if counter.measuring:
        counter.stats.num_iterations += 1
        counter.stats.num_prefill_iterations += int(is_prefill)

    policy.begin_iteration(contexts)
    cache = _prefetch(cache, policy, config, (), counter)
    for layer in range(trace.num_layers):
        layer_ids = topk_ids[:, layer]
        policy.observe_layer(layer, gate_probs[:, layer], layer_ids,
                             None if next_probs is None else next_probs[:, layer])
        needed = routed_experts(layer_ids)
        counter.routed(cache, layer, needed, is_prefill)
        update = load_on_demand(cache, policy, layer, needed)
        counter.evicted(update.evicted)
        cache = update.cache.use(layer, needed)
        cache = _prefetch(cache, policy, config, {(layer, e) for e in needed}, counter)
    policy.end_iteration(finished)
    return cache


def _prefetch(cache: CacheState, policy: OffloadPolicy, config: ReplayConfig, protected: Collection[ExpertKey],
              counter: _Counter) -> CacheState:
    update = run_prefetch(cache, policy, policy.prefetch_plan(cache), config.prefetch_per_layer, protected)
    counter.prefetched(update)
    return update.cache


def _embedding(trace: RoutingTrace, config: ReplayConfig, request: int, iteration: int) -> torch.Tensor:
    if config.semantic == "prompt":
        return trace.prompt_embedding[request]
    return trace.iteration_embedding[iteration]
