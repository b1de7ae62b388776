"""Turning per-expert numbers into the two orders the engine consumes: a prefetch plan
(best first) and a victim list (first to go first). Shared by every policy so that they
differ only in the numbers they feed in.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

import numpy as np
import numpy.typing as npt

from elasticmoe.kernels import finemoe_search
from elasticmoe.offload.cache_state import CacheState, ExpertKey
from elasticmoe.offload.policy import PrefetchItem, PrefetchPlan
from elasticmoe.offload.selection import prefetch_priority

FloatGrid = npt.NDArray[np.float64]
BoolGrid = npt.NDArray[np.bool_]


def plan_from_predictions(planned: BoolGrid, probs: FloatGrid, current_layer: int,
                          cache: CacheState) -> PrefetchPlan:
    """A plan of the `planned` [L, E] experts of layers after `current_layer` that are not
    resident, ordered by `prefetch_priority(probs[l, j], l, current_layer)` (FineMoE §4.5),
    ties by (layer, expert).

    It runs after every MoE layer of every step on the forward thread, on a few hundred
    values: the mask is one NumPy pass, and the few items it leaves are ranked in Python, where
    each NumPy call would cost more dispatch than its work (4-21 items: 10-20 us as NumPy calls
    and dataclasses, 4-15 us so)."""
    first = current_layer + 1
    wanted = np.flatnonzero(planned[first:] & ~cache.resident[first:])  # in (layer, expert) order
    if wanted.size == 0:  # the usual case once the cache holds the plan: no sort, no items
        return PrefetchPlan.ranked(current_layer, ())
    num_experts = planned.shape[1]
    items = []
    for index, prob in zip(wanted.tolist(), probs[first:].ravel()[wanted].tolist(), strict=True):
        layer, expert = divmod(index, num_experts)
        layer += first
        items.append(PrefetchItem(layer, expert, prefetch_priority(prob, layer, current_layer)))
    items.sort(key=_by_priority, reverse=True)  # stable: equal priorities stay in (layer, expert) order
    return PrefetchPlan.ranked(current_layer, tuple(items))


class PlanMaker:
    """`plan_from_predictions` over one policy's `planned` [L, E] and `probs` arrays, which the
    policy updates in place: by one kernel call where the kernels build (`finemoe_search.
    PlanRanker`: the same items in the same order), else by the NumPy function. A policy plans after
    every MoE layer of every step, on the forward thread, and the plan is mostly empty: the empty
    plan after each layer is made once."""

    def __init__(self, planned: BoolGrid, probs: FloatGrid) -> None:
        self.planned, self.probs = planned, probs
        self._num_experts = planned.shape[1]
        self._ranker = finemoe_search.plan_ranker(planned, probs)
        self._empty = [PrefetchPlan.ranked(layer, ()) for layer in range(-1, planned.shape[0])]

    def plan(self, current_layer: int, cache: CacheState) -> PrefetchPlan:
        if self._ranker is None:
            return plan_from_predictions(self.planned, self.probs, current_layer, cache)
        indices, priorities = self._ranker.rank(cache.resident, current_layer)
        if not indices:
            return self._empty[current_layer + 1]
        items = []
        for index, priority in zip(indices, priorities, strict=True):
            layer, expert = divmod(index, self._num_experts)
            items.append(PrefetchItem(layer, expert, priority))
        return PrefetchPlan.ranked(current_layer, tuple(items))


def _by_priority(item: PrefetchItem) -> float:
    return item.priority


def pick_victims(cache: CacheState, evict_first: FloatGrid, num_victims: int,
                 protected: Collection[ExpertKey]) -> list[ExpertKey]:
    """Up to `num_victims` resident, unprotected experts, by descending `evict_first` [L, E];
    ties go to the least recently used, then to the lower (layer, expert)."""
    if num_victims <= 0:
        return []
    candidates = _candidates(cache, protected)
    if num_victims == 1:  # a prefetch's victim: the same choice without sorting every candidate
        return _first_victim(candidates, evict_first, cache.last_used)
    layers, experts, order = _ranked(candidates, evict_first, cache.last_used)
    return [(int(layers[i]), int(experts[i])) for i in order[:num_victims]]


def _candidates(cache: CacheState, protected: Collection[ExpertKey]) -> BoolGrid:
    """The resident experts not `protected` [L, E]."""
    candidates = cache.resident.copy()
    for key in protected:
        candidates[key] = False
    return candidates


def _ranked(candidates: BoolGrid, evict_first: FloatGrid, last_used: npt.NDArray[np.int64]
            ) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64], npt.NDArray[np.int64]]:
    """`candidates`' (layers, experts) and the order that ranks them first victim first: by
    descending `evict_first`, then least recently used, then the lower (layer, expert)."""
    layers, experts = np.nonzero(candidates)
    # np.lexsort sorts by the last key first.
    return layers, experts, np.lexsort((experts, layers, last_used[layers, experts], -evict_first[layers, experts]))


def layer_shares(capacity: int, num_layers: int) -> list[int]:
    """Each layer's share of `capacity` rows under a per-layer partition: `capacity // L`, the first
    `capacity % L` layers one more (the shares sum to the capacity)."""
    base, extra = divmod(capacity, num_layers)
    return [base + (layer < extra) for layer in range(num_layers)]


def pick_victims_by_layer(cache: CacheState, evict_first: FloatGrid, for_layers: Sequence[int],
                          protected: Collection[ExpertKey]) -> list[ExpertKey]:
    """`pick_victims` under per-layer shares of the cache (`layer_shares`; Mixtral-Offloading keeps k
    experts per layer): one victim for each row to fill, `for_layers[i]` the layer victim i's row
    goes to. A layer holding its share or more gives up its own first candidate; otherwise (or when
    none of its own is left) the first candidate of the layers above their shares goes; failing
    that, the first candidate of any layer. Each candidate ranks as in `pick_victims` (descending
    `evict_first`, then least recently used, then the lower (layer, expert)). Fewer come back only
    when fewer candidates are resident.

    A global order would cycle: with an iteration's experts more than the cache holds, a pass over
    the layers evicts exactly the next layers' experts, whatever the cache's size (docs/offload.md,
    the batch-16 section)."""
    if not for_layers:
        return []
    layers, experts, order = _ranked(_candidates(cache, protected), evict_first, cache.last_used)
    # each layer's candidates in rank order, as (rank, expert); a layer's head is its first
    queues: list[list[tuple[int, int]]] = [[] for _ in range(cache.num_layers)]
    for rank, i in enumerate(order.tolist()):
        queues[int(layers[i])].append((rank, int(experts[i])))
    heads = [0] * cache.num_layers
    held = cache.resident.sum(axis=1).tolist()
    shares = layer_shares(cache.capacity, cache.num_layers)

    def best_of(donors: list[int]) -> int | None:
        open_ = [d for d in donors if heads[d] < len(queues[d])]
        return min(open_, key=lambda d: queues[d][heads[d]][0]) if open_ else None

    victims = []
    every_layer = list(range(cache.num_layers))
    for layer in for_layers:
        donor = best_of([layer]) if held[layer] >= shares[layer] else None
        if donor is None:
            donor = best_of([d for d in every_layer if d != layer and held[d] > shares[d]])
        if donor is None:
            donor = best_of(every_layer)
        if donor is None:
            break
        victims.append((donor, queues[donor][heads[donor]][1]))
        heads[donor] += 1
        held[donor] -= 1
        held[layer] += 1
    return victims


def _first_victim(candidates: BoolGrid, evict_first: FloatGrid, last_used: npt.NDArray[np.int64]
                  ) -> list[ExpertKey]:
    """`pick_victims`' first victim among `candidates` [L, E] (the prefetch thread asks for one per
    copy, beside the forward: each NumPy call it saves is GIL time the forward gets back)."""
    if not candidates.any():
        return []
    score = np.where(candidates, evict_first, -np.inf)
    tied = candidates & (score == score.max())
    if np.count_nonzero(tied) > 1:  # equal priorities: the least recently used, then the lowest key
        stamps = np.where(tied, last_used, np.iinfo(np.int64).max)
        tied &= stamps == stamps.min()
    layer, expert = divmod(int(np.argmax(tied)), candidates.shape[1])  # the first in (layer, expert) order
    return [(layer, expert)]
