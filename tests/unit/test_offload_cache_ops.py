"""The engine's side of the decisions: on-demand loads and prefetch copies over a CacheState."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from elasticmoe.offload import (
    CacheState,
    CacheTooSmallError,
    PolicyConfig,
    PrefetchItem,
    PrefetchPlan,
    load_on_demand,
    routed_experts,
    run_prefetch,
)
from elasticmoe.offload.lru import OnDemandPolicy
from elasticmoe.offload.ranking import pick_victims, plan_from_predictions

POLICY = OnDemandPolicy(PolicyConfig(num_layers=3, num_experts=4, top_k=2, lru_per_layer=False))  # LRU victims by age


def make_cache(capacity: int, *loads: list[tuple[int, int]]) -> CacheState:
    """A cache with each group of `loads` loaded one clock tick after the previous."""
    cache = CacheState.empty(3, 4, capacity)
    for keys in loads:
        cache = cache.load(keys)
    return cache


def make_plan(after_layer: int, *keys: tuple[int, int]) -> PrefetchPlan:
    n = len(keys)
    return PrefetchPlan(after_layer, tuple(PrefetchItem(layer, e, float(n - i)) for i, (layer, e) in enumerate(keys)))


def test_routed_experts_are_each_id_once():
    assert routed_experts(torch.tensor([[3, 1], [1, 0]])) == [0, 1, 3]


def test_on_demand_load_evicts_victims_but_never_the_layers_own_experts():
    cache = make_cache(3, [(1, 0)], [(0, 1)], [(2, 2)])  # (1, 0) is the least recent
    update = load_on_demand(cache, POLICY, 1, [0, 3])
    assert update.loaded == ((1, 3),) and update.evicted == ((0, 1),)  # (1, 0) is routed here: spared
    assert update.cache.resident_keys() == [(1, 0), (1, 3), (2, 2)]
    assert load_on_demand(update.cache, POLICY, 1, [0, 3]).loaded == ()  # all hits
    with pytest.raises(CacheTooSmallError, match="holds 3"):
        load_on_demand(cache, POLICY, 0, [0, 1, 2, 3])


def test_a_prefetch_never_evicts_what_its_plan_holds():
    cache = make_cache(3, [(1, 1)], [(0, 0)], [(2, 3)])
    plan = make_plan(0, (1, 1), (2, 0), (2, 1))  # (1, 1) is planned, (2, 3) is not
    update = run_prefetch(cache, POLICY, plan, None, protected={(0, 0)})
    assert update.loaded == ((2, 0),) and update.evicted == ((2, 3),)  # then only planned or protected left
    assert run_prefetch(update.cache, POLICY, plan, None, protected={(0, 0)}).loaded == ()
    assert run_prefetch(update.cache, POLICY, plan, None).loaded == ((2, 1),)  # (0, 0) once its layer is done


@pytest.mark.parametrize(("per_layer", "victims"), [(False, [(0, 0), (1, 2), (2, 3)]),
                                                    (True, [(1, 2), (0, 0), (2, 3)])])
def test_run_prefetch_makes_the_same_decisions_as_one_step_at_a_time(per_layer, victims):
    """Victims asked for at once equal victims asked for before each copy (the policy's rank of
    the others does not change when a planned, protected expert arrives). Per layer (shares 2, 1,
    1 of 4 rows): layer 1 gives up its own (1, 2) for its first row; for its second it has no
    candidate left and no layer holds more than its share, so the oldest of any goes."""
    policy = OnDemandPolicy(PolicyConfig(num_layers=3, num_experts=4, top_k=2, lru_per_layer=per_layer))
    cache = make_cache(4, [(0, 0)], [(0, 1)], [(1, 2)], [(2, 3)])
    plan = make_plan(0, (1, 0), (1, 1), (2, 0), (2, 1))
    update = run_prefetch(cache, policy, plan, max_loads=3, protected={(0, 1)})
    stepped, loaded, evicted = cache, [], []
    for item in plan.items[:3]:
        if stepped.is_full:
            victim = policy.choose_victims(stepped, 1, {(0, 1)} | plan.keys, for_layers=[item.layer])[0]
            stepped = stepped.evict([victim])
            evicted.append(victim)
        stepped = stepped.load([item.key])
        loaded.append(item.key)
    assert list(update.loaded) == loaded == [(1, 0), (1, 1), (2, 0)]
    assert list(update.evicted) == evicted == victims
    assert update.cache.resident_keys() == stepped.resident_keys()
    assert run_prefetch(cache, policy, plan, None, {(0, 1)}).loaded == ((1, 0), (1, 1), (2, 0))  # then full


def test_plans_are_ordered_and_for_later_layers():
    with pytest.raises(ValueError, match="descending"):
        PrefetchPlan(0, (PrefetchItem(1, 0, 0.1), PrefetchItem(1, 1, 0.5)))
    with pytest.raises(ValueError, match="holds layer 0"):
        PrefetchPlan(0, (PrefetchItem(0, 0, 0.1),))
    with pytest.raises(ValueError, match="twice"):
        PrefetchPlan(0, (PrefetchItem(1, 0, 0.5), PrefetchItem(1, 0, 0.1)))


def test_a_plan_from_predictions_ranks_p_over_distance_and_skips_the_resident():
    planned = np.zeros((3, 4), dtype=np.bool_)
    probs = np.zeros((3, 4))
    for layer, expert, p in [(0, 1, 0.9), (1, 0, 0.2), (1, 3, 0.6), (2, 2, 0.4), (2, 3, 0.3)]:
        planned[layer, expert], probs[layer, expert] = True, p
    cache = make_cache(12, [(2, 3)])  # resident: left out
    plan = plan_from_predictions(planned, probs, 0, cache)  # after layer 0: its expert is not planned
    # p / (l - l_now): (1, 3) 0.6, (1, 0) 0.2 and (2, 2) 0.4 / 2 = 0.2, a tie kept in (layer, expert) order
    assert [(i.layer, i.expert) for i in plan.items] == [(1, 3), (1, 0), (2, 2)]
    assert [i.priority for i in plan.items] == pytest.approx([0.6, 0.2, 0.2])
    assert plan.after_layer == 0 and plan.keys == {(1, 3), (1, 0), (2, 2)}
    assert PrefetchPlan(plan.after_layer, plan.items) == plan  # made unchecked, it passes the checks
    assert plan_from_predictions(planned, probs, 2, cache).items == ()


def test_one_victim_is_the_first_of_the_full_ranking_ties_included():
    # pick_victims answers a single victim without sorting; it must be the ranking's first, whatever
    # the ties: equal priorities go to the least recently used, then to the lowest (layer, expert).
    gen = np.random.default_rng(0)
    for trial in range(300):
        cache = CacheState.empty(3, 4, 12)
        for _ in range(int(gen.integers(1, 5))):  # loads in rounds: equal stamps within a round
            absent = [k for k in np.ndindex(3, 4) if not cache.is_resident(k)]
            picks = gen.choice(len(absent), size=min(len(absent), int(gen.integers(1, 4))), replace=False)
            cache = cache.load([absent[i] for i in picks])
        priority = gen.integers(0, 3, size=(3, 4)).astype(np.float64)  # few values: many ties
        resident = cache.resident_keys()
        protected = {resident[i] for i in gen.choice(len(resident), size=int(gen.integers(0, len(resident) + 1)),
                                                     replace=False)}
        ranking = pick_victims(cache, priority, 12, protected)
        assert pick_victims(cache, priority, 1, protected) == ranking[:1], trial
