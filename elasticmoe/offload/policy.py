"""The interface every expert-offloading policy implements, and the values that cross it.

How an engine step drives a policy (batch of requests, MoE layers 0..L-1; `cache_ops`
holds the decisions the engine and its prefetch thread take):

    policy.begin_iteration([RequestContext(id, num_tokens, embedding, is_prefill), ...])
    prefetcher.submit(policy.prefetch_plan(cache))        # for layers 0.. while layer 0's attention runs
    for layer in range(L):
        probs, topk_ids = router(x)                        # [T, E], [T, k]
        policy.observe_layer(layer, probs, topk_ids, next_gate_probs)  # next: only if needs_next_layer_gate
        needed = routed_experts(topk_ids)
        prefetcher.pause()                                 # the forward needs the copy engine now
        update = load_on_demand(cache, policy, layer, needed)   # never evicts `needed`
        cache = update.cache.use(layer, needed)            # one visit each (frequencies)
        prefetcher.submit(policy.prefetch_plan(cache))     # supersedes the old plan; resumes
        x = experts(x)                                     # meanwhile the prefetcher copies
    policy.end_iteration(finished_request_ids)

The cache (`CacheState`) belongs to the engine; a policy reads it and never keeps it. A
plan is an immutable, priority-ordered list: the engine turns it into copies at once
(`cache_ops.run_prefetch`: each expert with its victim) that a copier makes beside the
forward, cancels the copies not started when a newer plan arrives, and stops between copies
while an on-demand load runs (pause, FineMoE §4.5 "On-demand expert loading").

NOTE: policies are not thread-safe. Call every method from one thread, or hold one lock
around each call (they are small: a few [L, E] operations and one search over the store).
The engine calls them all on its forward thread.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple, Protocol

import torch

from elasticmoe.offload.cache_state import CacheState, ExpertKey

# Which tokens a request's semantic embedding is the mean over: those its iteration feeds
# ("iteration", the default: FineMoE hits more often with it on a trained model), or its prompt's
# at every iteration ("prompt"). The measurements are in docs/offload.md ("What the paper leaves
# open").
SEMANTIC_SOURCES = ("iteration", "prompt")


@dataclass(frozen=True, slots=True, eq=False)
class RequestContext:
    """One request's part of an iteration.

    Its tokens are rows `[offset, offset + num_tokens)` of every layer's gate output, where
    `offset` sums the `num_tokens` of the requests before it in `begin_iteration`'s list.

    `embedding` [h] is the request's semantic embedding (FineMoE §4.2.1: the embedding
    layer's output, recorded "for each inference iteration"): the mean of the model's own
    input-embedding rows over the tokens this iteration feeds for the request (the prompt, or
    its chunk, at prefill; the last sampled token at decode). `SEMANTIC_SOURCES` names the
    other reading, the prompt's mean presented again at every decode iteration.
    """

    request_id: str
    num_tokens: int
    embedding: torch.Tensor
    is_prefill: bool = False

    def __post_init__(self) -> None:
        if self.num_tokens < 1:
            raise ValueError(f"request {self.request_id!r}: num_tokens must be >= 1, got {self.num_tokens}")
        if self.embedding.dim() != 1 or self.embedding.numel() == 0:
            raise ValueError(f"request {self.request_id!r}: embedding must be a non-empty vector [h], "
                             f"got shape {tuple(self.embedding.shape)}")


class PrefetchItem(NamedTuple):
    """One expert of a plan. A named tuple, not a dataclass: plans are made after every MoE layer
    of every step, and a tuple is made ~3x faster."""

    layer: int
    expert: int
    priority: float  # larger = sooner

    @property
    def key(self) -> ExpertKey:
        return (self.layer, self.expert)


@dataclass(frozen=True, slots=True)
class PrefetchPlan:
    """Experts to copy in, best first; none was resident when the plan was made.

    `after_layer` is the layer the forward had reached (-1: none yet); every item is for a
    later layer. A newer plan supersedes an older one entirely.
    """

    after_layer: int
    items: tuple[PrefetchItem, ...] = ()
    keys: frozenset[ExpertKey] = field(init=False)  # the items' experts

    def __post_init__(self) -> None:
        for item in self.items:
            if item.layer <= self.after_layer:
                raise ValueError(f"prefetch plan after layer {self.after_layer} holds layer {item.layer}")
        priorities = [item.priority for item in self.items]
        if priorities != sorted(priorities, reverse=True):
            raise ValueError("prefetch plan: items must be in descending priority")
        keys = frozenset(item.key for item in self.items)
        if len(keys) != len(self.items):
            raise ValueError("prefetch plan: an expert appears twice")
        object.__setattr__(self, "keys", keys)

    @classmethod
    def ranked(cls, after_layer: int, items: tuple[PrefetchItem, ...]) -> PrefetchPlan:
        """A plan whose `items` the caller ranked itself (`ranking.plan_from_predictions`: distinct
        experts after `after_layer`, sorted), made without the checks: a plan is made after every
        MoE layer of every step. Tests check that such plans pass them."""
        plan = object.__new__(cls)
        object.__setattr__(plan, "after_layer", after_layer)
        object.__setattr__(plan, "items", items)
        object.__setattr__(plan, "keys", frozenset(item.key for item in items))
        return plan


@dataclass(frozen=True, slots=True)
class PolicyConfig:
    """The model's MoE shape and the knobs the policies share.

    `prefetch_distance` d (FineMoE §4.2): a prediction for layer l is made once layer l - d
    has been routed; the first d layers come from the semantic search (FineMoE) or from the
    request's history (LFU). `store_capacity` C bounds FineMoE's Expert Map Store (§4.4) and
    the LFU baseline's collection of activation matrices alike.
    """

    num_layers: int
    num_experts: int
    top_k: int
    prefetch_distance: int = 1
    store_capacity: int = 1000
    # `lru` and `on_demand` evict by layer: each layer keeps its share of the rows (Mixtral-Offloading's
    # k experts per layer, at the same total); False: one LRU order over every layer's experts
    lru_per_layer: bool = True

    def __post_init__(self) -> None:
        if self.num_layers < 1 or self.num_experts < 1:
            raise ValueError(f"policy config: need >= 1 layer and expert, got {self.num_layers}, {self.num_experts}")
        if not 1 <= self.top_k <= self.num_experts:
            raise ValueError(f"policy config: top_k must be in [1, {self.num_experts}], got {self.top_k}")
        if not 1 <= self.prefetch_distance <= self.num_layers:
            raise ValueError(f"policy config: prefetch_distance must be in [1, {self.num_layers}], "
                             f"got {self.prefetch_distance}")
        if self.store_capacity < 1:
            raise ValueError(f"policy config: store_capacity must be >= 1, got {self.store_capacity}")


class OffloadPolicy(Protocol):
    """Decides what to prefetch and what to evict; the engine does the copies."""

    name: str
    # False when `observe_layer` changes nothing (on_demand): the engine then skips computing the
    # gate's probabilities and calling it.
    observes_layers: bool
    # True when `observe_layer` wants `next_gate_probs` (layer l+1's gate applied to layer l's
    # router input: one [T, H] x [H, E] matmul the engine skips otherwise).
    needs_next_layer_gate: bool

    def begin_iteration(self, requests: Sequence[RequestContext]) -> None:
        """A new iteration over `requests` (batch order = token order). Forgets the previous
        iteration's plan; the forward is before layer 0."""
        ...

    def observe_layer(self, layer: int, gate_probs: torch.Tensor, topk_ids: torch.Tensor,
                      next_gate_probs: torch.Tensor | None = None) -> None:
        """Layer `layer`'s router ran: `gate_probs` [T, E] (softmax over all experts, rows sum
        to 1) and the routed `topk_ids` [T, k] of every token of the iteration. Layers arrive
        in order 0..L-1, once each."""
        ...

    def prefetch_plan(self, cache: CacheState) -> PrefetchPlan:
        """What to copy in next for layers after the last observed one, best first; experts
        already in `cache` are left out. Reads `cache.resident` only: the engine may hand a
        snapshot whose usage (stamps, visits) does not yet count the step's latest lookups."""
        ...

    def choose_victims(self, cache: CacheState, num_victims: int, protected: Collection[ExpertKey],
                       for_layers: Sequence[int] = ()) -> list[ExpertKey]:
        """Up to `num_victims` resident experts to evict, first victim first, none of them in
        `protected` (the engine passes at least the experts the current layer routed to).
        Fewer come back only when fewer unprotected experts are resident. `for_layers` (when
        given, `num_victims` of them): the layer each victim's row goes to, which a policy that
        partitions the cache by layer needs (`PolicyConfig.lru_per_layer`)."""
        ...

    def end_iteration(self, finished_request_ids: Collection[str] = ()) -> None:
        """The iteration's layers all ran; requests in `finished_request_ids` (finished or
        aborted) will not come back, so their per-request state can go."""
        ...
