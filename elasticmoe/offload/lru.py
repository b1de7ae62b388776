"""Baselines with least-recently-used eviction.

`lru` — Mixtral-Offloading (Eliseev and Mazur, 2023): an LRU expert cache plus speculative
prefetching of the next layer only. After layer l's router ran, the engine applies layer
l+1's gate to layer l's router input (`next_gate_probs`); the residual stream changes little
between consecutive layers, so its top-k per token guesses layer l+1's experts. The guess
is approximate in two ways, on purpose: layer l+1's gate normally sees that layer's own
attention output and RMSNorm, and the guess is made one layer ahead only (prefetch
distance 1, whatever `PolicyConfig.prefetch_distance` says).

When the engine cannot give `next_gate_probs` (only the gate probabilities are at hand),
the guess for layer l+1 is the set of experts layer l+1 ran in the previous iteration:
consecutive decode tokens of one request tend to repeat experts, and it needs nothing but
the routing already observed. This fallback is ours, not Mixtral-Offloading's.

Mixtral-Offloading keeps an LRU cache of k experts per layer; here each layer keeps its share
of the global slot budget of `CacheState` (`ranking.pick_victims_by_layer`: the same memory as
every policy, rows lent between layers where a layer needs more than its share at once), and
`PolicyConfig.lru_per_layer=False` ranks every layer's experts in one LRU order instead. One order
cycles under load: when an iteration routes to more experts than the cache holds, each pass over
the layers evicts the next layers' experts, whatever the cache's size.

`on_demand` — DeepSpeed-Inference-like: no prefetching at all, experts loaded when routed,
evicted least recently used within each layer's share as `lru` (FineMoE §6.1 adds this expert
cache to DeepSpeed-Inference for a fair comparison).
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

import numpy as np
import torch

from elasticmoe.offload.cache_state import CacheState, ExpertKey
from elasticmoe.offload.policy import PolicyConfig, PrefetchPlan, RequestContext
from elasticmoe.offload.ranking import PlanMaker, pick_victims, pick_victims_by_layer


def lru_victims(cache: CacheState, num_victims: int, protected: Collection[ExpertKey],
                for_layers: Sequence[int] = (), per_layer: bool = True) -> list[ExpertKey]:
    """The least recently used (or loaded) unprotected experts first; `per_layer` with `for_layers`
    (the layer each victim's row goes to, `num_victims` of them): within each layer's share of the
    cache (`pick_victims_by_layer`, `PolicyConfig.lru_per_layer`)."""
    newest_last = -cache.last_used.astype(np.float64)
    if per_layer and for_layers:
        return pick_victims_by_layer(cache, newest_last, for_layers, protected)
    return pick_victims(cache, newest_last, num_victims, protected)


def speculative_guess(next_gate_probs: torch.Tensor, top_k: int) -> dict[int, float]:
    """Layer l+1's experts guessed from its gate on layer l's input `next_gate_probs` [T, E]:
    the union of every token's top-k, each with its largest probability over the tokens."""
    probs, ids = torch.topk(next_gate_probs.float(), top_k, dim=1)
    guess: dict[int, float] = {}
    for expert, prob in zip(ids.flatten().tolist(), probs.flatten().tolist(), strict=True):
        guess[expert] = max(prob, guess.get(expert, 0.0))
    return guess


class LRUPolicy:
    """`OffloadPolicy` of Mixtral-Offloading: next-layer speculation, LRU eviction."""

    name = "lru"
    needs_next_layer_gate = True
    observes_layers = True

    def __init__(self, config: PolicyConfig) -> None:
        self.config = config
        shape = (config.num_layers, config.num_experts)
        self._current_layer = -1
        self._planned = np.zeros(shape, dtype=np.bool_)
        self._planned_probs = np.zeros(shape, dtype=np.float64)
        self._plans = PlanMaker(self._planned, self._planned_probs)  # reads both in place
        self._routed = np.zeros(shape, dtype=np.bool_)  # this iteration
        self._previously_routed = np.zeros(shape, dtype=np.bool_)  # the last complete iteration

    def begin_iteration(self, requests: Sequence[RequestContext]) -> None:
        if not requests:
            raise ValueError("begin_iteration: an iteration needs at least one request")
        self._current_layer = -1
        self._planned[:] = False
        self._routed[:] = False

    def observe_layer(self, layer: int, gate_probs: torch.Tensor, topk_ids: torch.Tensor,
                      next_gate_probs: torch.Tensor | None = None) -> None:
        if layer != self._current_layer + 1:
            raise ValueError(f"observe_layer: expected layer {self._current_layer + 1}, got {layer}")
        self._current_layer = layer
        self._routed[layer, topk_ids.unique().tolist()] = True
        target = layer + 1
        if target >= self.config.num_layers:
            return
        if next_gate_probs is not None:
            guess = speculative_guess(next_gate_probs, self.config.top_k)
        else:
            guess = {int(e): 1.0 for e in np.nonzero(self._previously_routed[target])[0]}
        for expert, prob in guess.items():
            self._planned[target, expert] = True
            self._planned_probs[target, expert] = prob

    def prefetch_plan(self, cache: CacheState) -> PrefetchPlan:
        return self._plans.plan(self._current_layer, cache)

    def choose_victims(self, cache: CacheState, num_victims: int, protected: Collection[ExpertKey],
                       for_layers: Sequence[int] = ()) -> list[ExpertKey]:
        return lru_victims(cache, num_victims, protected, for_layers, self.config.lru_per_layer)

    def end_iteration(self, finished_request_ids: Collection[str] = ()) -> None:
        if self._current_layer == self.config.num_layers - 1:
            self._previously_routed = self._routed.copy()
        self._current_layer = -1
        self._planned[:] = False


class OnDemandPolicy:
    """`OffloadPolicy` that never prefetches; experts come in when routed, LRU eviction."""

    name = "on_demand"
    needs_next_layer_gate = False
    observes_layers = False  # routing never changes its decisions

    def __init__(self, config: PolicyConfig) -> None:
        self.config = config
        self._current_layer = -1

    def begin_iteration(self, requests: Sequence[RequestContext]) -> None:
        self._current_layer = -1

    def observe_layer(self, layer: int, gate_probs: torch.Tensor, topk_ids: torch.Tensor,
                      next_gate_probs: torch.Tensor | None = None) -> None:
        self._current_layer = layer

    def prefetch_plan(self, cache: CacheState) -> PrefetchPlan:
        return PrefetchPlan(self._current_layer)

    def choose_victims(self, cache: CacheState, num_victims: int, protected: Collection[ExpertKey],
                       for_layers: Sequence[int] = ()) -> list[ExpertKey]:
        return lru_victims(cache, num_victims, protected, for_layers, self.config.lru_per_layer)

    def end_iteration(self, finished_request_ids: Collection[str] = ()) -> None:
        self._current_layer = -1
