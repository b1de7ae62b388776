"""The engine side of a policy's decisions, as pure steps over a `CacheState`: what an
on-demand load evicts and loads, and which copies a prefetch plan queues. The copies
themselves are the engine's; these functions only decide, so the engine's expert cache and
the simulator (`replay`) share one logic.

Two rules hold for every eviction:
- an expert the current layer routed to is never evicted (the engine passes them as
  `protected`);
- a prefetch never evicts an expert of the plan it runs (it would evict what it just
  loaded for a nearer layer), so a cache full of the plan's experts ends the plan.
An on-demand load may evict planned experts: the forward cannot wait.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass

import torch

from elasticmoe.offload.cache_state import CacheState, ExpertKey
from elasticmoe.offload.policy import OffloadPolicy, PrefetchPlan


class CacheTooSmallError(ValueError):
    """One layer routed to more experts than the cache can hold at once."""


@dataclass(frozen=True, slots=True, eq=False)
class CacheUpdate:
    """A new cache snapshot and the copies that lead to it (evictions happen first)."""

    cache: CacheState
    loaded: tuple[ExpertKey, ...] = ()
    evicted: tuple[ExpertKey, ...] = ()


def routed_experts(topk_ids: torch.Tensor) -> list[int]:
    """The experts a layer must have resident before its GEMM: every routed id, once."""
    return sorted(set(topk_ids.flatten().tolist()))


def load_on_demand(cache: CacheState, policy: OffloadPolicy, layer: int, expert_ids: Collection[int],
                   protected: Collection[ExpertKey] = ()) -> CacheUpdate:
    """Make layer `layer`'s `expert_ids` resident now, evicting the policy's victims (never one of
    `expert_ids` or of `protected`: the engine protects an expert whose prefetch copy is in flight).

    Raises `CacheTooSmallError` when the layer needs more experts than the cache holds
    (the engine would then run the layer's experts in waves; the simulator sizes its cache
    to at least one layer's experts)."""
    missing = cache.missing(layer, expert_ids)
    if not missing:
        return CacheUpdate(cache)
    num_short = len(missing) - cache.num_free
    victims: list[ExpertKey] = []
    if num_short > 0:
        victims = policy.choose_victims(cache, num_short, {(layer, int(e)) for e in expert_ids} | set(protected),
                                        for_layers=[layer] * num_short)
        if len(victims) < num_short:
            raise CacheTooSmallError(f"layer {layer} needs {len(set(expert_ids))} experts resident at once; "
                                     f"the cache holds {cache.capacity}")
    loaded = tuple((layer, e) for e in missing)
    return CacheUpdate(cache.evict(victims).load(loaded), loaded, tuple(victims))


def run_prefetch(cache: CacheState, policy: OffloadPolicy, plan: PrefetchPlan, max_loads: int | None,
                 protected: Collection[ExpertKey] = ()) -> CacheUpdate:
    """Run `plan` for at most `max_loads` copies (None: to the end): the plan's experts not
    resident, in order, into free slots and then in place of the policy's victims (never one of
    `protected` or of the plan: it would evict what it just loaded for a nearer layer), until
    nothing more may be evicted.

    The victims are asked for at once: loading a planned expert (protected) does not change
    how the policies rank the others, so the same victims come out in the same order as when
    asked one copy at a time (only the clock stamps differ: the items loaded together share
    one). The engine queues these copies on its copier; the simulator applies them."""
    items = [item.key for item in plan.items if not cache.is_resident(item.key)]
    if max_loads is not None:
        items = items[:max_loads]
    num_short = len(items) - cache.num_free
    victims: list[ExpertKey] = []
    if num_short > 0:
        # the victims' rows go to the items after those the free rows take
        victims = policy.choose_victims(cache, num_short, set(protected) | plan.keys,
                                        for_layers=[layer for layer, _ in items[cache.num_free :]])
        items = items[: cache.num_free + len(victims)]  # the plan ends where nothing more may go
    return CacheUpdate(cache.evict(victims).load(items), tuple(items), tuple(victims))
