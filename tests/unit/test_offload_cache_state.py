"""The expert cache snapshot: residency under a global slot budget, and how visits are counted."""

from __future__ import annotations

import numpy as np
import pytest

from elasticmoe.offload.cache_state import CacheState


def make_cache(capacity: int = 4, num_layers: int = 2, num_experts: int = 3, resident=()) -> CacheState:
    return CacheState.empty(num_layers, num_experts, capacity).load(list(resident))


def test_load_evict_and_the_global_budget():
    cache = make_cache(capacity=3, resident=[(0, 1), (1, 2)])
    assert cache.resident_keys() == [(0, 1), (1, 2)]
    assert (cache.num_resident, cache.num_free, cache.is_full) == (2, 1, False)
    assert cache.missing(0, [1, 0, 0, 2]) == [0, 2]
    full = cache.load([(1, 0)])  # any layer may take the free slot
    assert full.is_full
    with pytest.raises(ValueError, match="do not fit"):
        full.load([(0, 0)])
    with pytest.raises(ValueError, match="already resident"):
        cache.load([(0, 1)])
    assert full.evict([(0, 1)]).resident_keys() == [(1, 0), (1, 2)]
    with pytest.raises(ValueError, match="not resident"):
        cache.evict([(0, 0)])
    assert cache.resident_keys() == [(0, 1), (1, 2)]  # transitions never touch the old snapshot


def test_the_resident_count_follows_every_transition():
    """The count is kept by the transitions, not recounted: each one must move it exactly."""
    cache = make_cache(capacity=4, resident=[(0, 0), (0, 1)])
    steps = [lambda c: c.load([(1, 0), (1, 1)]), lambda c: c.evict([(0, 1), (1, 0)]),
             lambda c: c.reinstate([(0, 1)]), lambda c: c.use(0, [0, 1]), lambda c: c.evict([(0, 0)])]
    for step in steps:
        cache = step(cache)
        assert cache.num_resident == int(cache.resident.sum())
        assert cache.num_free == cache.capacity - cache.num_resident
        cache.check_integrity()
    assert cache.resident_keys() == [(0, 1), (1, 1)]
    with pytest.raises(ValueError, match="do not fit"):
        cache.load([(0, 0), (0, 2), (1, 0)])  # 3 into 2 free slots


def test_a_visit_is_one_lookup_whatever_the_number_of_tokens():
    cache = make_cache(resident=[(0, 0), (0, 1)])
    # a prefill routing 5 tokens to expert 0 and 1 token to expert 1: one visit each
    cache = cache.use(0, [0, 0, 0, 0, 0, 1])
    cache = cache.use(0, [0])  # the next iteration's lookup
    assert cache.num_uses[0].tolist() == [2, 1, 0]


def test_visit_counts_outlive_eviction_and_stamps_order_loads_and_uses():
    cache = make_cache(resident=[(0, 0)])  # loaded at clock 0
    cache = cache.use(0, [0])  # clock 1
    cache = cache.evict([(0, 0)]).load([(0, 0), (1, 1)])  # clock 2
    assert cache.num_uses[0, 0] == 1  # popularity survives the round trip
    assert cache.last_used[0, 0] == 2 and cache.last_used[1, 1] == 2 and cache.clock == 3
    with pytest.raises(ValueError, match="not resident"):
        cache.use(1, [0])
    cache.check_integrity()


def test_snapshots_are_read_only_and_validated():
    cache = make_cache(resident=[(0, 0)])
    with pytest.raises(ValueError):
        cache.resident[0, 1] = True
    with pytest.raises(ValueError, match="capacity"):
        CacheState(1, np.ones((2, 2), dtype=np.bool_), np.zeros((2, 2), dtype=np.int64),
                   np.zeros((2, 2), dtype=np.int64), clock=1)
    with pytest.raises(ValueError, match=r"\[L, E\]"):
        CacheState(4, np.zeros((2, 2), dtype=np.bool_), np.zeros((2, 3), dtype=np.int64),
                   np.zeros((2, 2), dtype=np.int64))
    stale = CacheState(4, np.zeros((1, 2), dtype=np.bool_), np.array([[5, -1]]), np.zeros((1, 2), dtype=np.int64))
    with pytest.raises(ValueError, match="clock"):
        stale.check_integrity()
    with pytest.raises(ValueError, match=">= 1 expert slot"):
        CacheState.empty(2, 2, 0)
    # transitions make their snapshots without construction's checks: they must be read-only too
    after = cache.load([(1, 1)]).use(1, [1]).evict([(0, 0)])
    for arr in (after.resident, after.last_used, after.num_uses):
        with pytest.raises(ValueError):
            arr[1, 1] = 0
    after.check_integrity()


def test_reinstate_puts_an_evicted_expert_back_as_it_was():
    """A prefetch cancelled before it wrote its victim's row gives the victim back: resident again
    with its old stamp and visits (LRU still sees it as old), the clock unchanged."""
    cache = CacheState.empty(2, 3, capacity=2).load([(0, 0)]).load([(1, 1)]).use(0, [0])
    evicted = cache.evict([(0, 0)]).load([(1, 2)])
    back = evicted.evict([(1, 2)]).reinstate([(0, 0)])
    assert back.resident_keys() == [(0, 0), (1, 1)]
    assert back.last_used[0, 0] == cache.last_used[0, 0] and back.num_uses[0, 0] == 1
    assert back.clock == evicted.clock
    back.check_integrity()
    with pytest.raises(ValueError, match="already resident"):
        back.reinstate([(0, 0)])
    with pytest.raises(ValueError, match="do not fit"):
        evicted.reinstate([(0, 0)])  # (1, 2) still holds the slot


def test_many_uses_at_once_equal_the_chain_of_uses():
    """`use_many` (the engine applies a step's lookups together) is the chain of `use`s: stamps,
    visits, clock and the halving inside the batch; a lookup of no experts advances nothing, and
    one of an evicted expert is refused whole, the snapshot untouched."""
    start = CacheState.empty(3, 4, capacity=8, ageing_window=7).load([(0, 0), (0, 1), (1, 2), (2, 3)])
    uses = [(0, [0, 1]), (1, []), (1, [2, 2]), (0, [1]), (2, [3]), (0, [0, 1]), (1, [2])]  # the 7th visit halves
    chained = start
    for layer, ids in uses:
        chained = chained.use(layer, ids)
    batched = start.use_many(uses)
    for name in ("resident", "last_used", "num_uses"):
        assert getattr(batched, name).tolist() == getattr(chained, name).tolist(), name
    assert (batched.clock, batched.visits_since_ageing) == (chained.clock, chained.visits_since_ageing) == (7, 1)
    assert start.use_many([]) is start and start.use_many([(0, [])]) is start
    with pytest.raises(ValueError, match=r"layer 1 experts \[0\] are not resident"):
        start.use_many([(0, [0]), (1, [0])])
    assert start.num_uses.sum() == 0 and start.clock == 1  # one load
    batched.check_integrity()


def test_visit_counts_halve_every_window_and_keep_their_order():
    cache = CacheState.empty(2, 3, capacity=6, ageing_window=10).load([(0, 0), (0, 1), (0, 2), (1, 0)])
    for _ in range(3):  # 9 visits: below the window
        cache = cache.use(0, [0, 1, 2])
    assert cache.num_uses[0].tolist() == [3, 3, 3] and cache.visits_since_ageing == 9
    aged = cache.use(0, [0]).use(1, [0])  # the 10th visit halves every count (4, 3, 3); then one more
    assert aged.num_uses.tolist() == [[2, 1, 1], [1, 0, 0]] and aged.visits_since_ageing == 1
    assert cache.num_uses[0].tolist() == [3, 3, 3]  # the old snapshot is untouched
    aged.check_integrity()
    never = CacheState.empty(1, 2, capacity=2, ageing_window=0).load([(0, 0)])
    for _ in range(50):
        never = never.use(0, [0])
    assert never.num_uses[0, 0] == 50
    assert CacheState.empty(8, 32, capacity=64).ageing_window == 16 * 8 * 32  # the default
    with pytest.raises(ValueError, match="ageing"):
        CacheState.empty(1, 2, capacity=2, ageing_window=-1)


def test_a_traffic_shift_outranks_a_long_past_within_a_few_windows():
    """A day of one topic must not pin its experts: after the shift, the new experts' counts pass
    the old ones' within a few windows, where without ageing they would need as many visits again."""
    window = 40
    cache = CacheState.empty(1, 4, capacity=4, ageing_window=window).load([(0, 0), (0, 1), (0, 2), (0, 3)])
    unaged = CacheState.empty(1, 4, capacity=4, ageing_window=0).load([(0, 0), (0, 1), (0, 2), (0, 3)])
    for _ in range(2000):  # the past: experts 0 and 1
        cache, unaged = cache.use(0, [0, 1]), unaged.use(0, [0, 1])
    steps = 0
    while cache.num_uses[0, 2] <= cache.num_uses[0, 0]:  # the present: experts 2 and 3
        cache, unaged, steps = cache.use(0, [2, 3]), unaged.use(0, [2, 3]), steps + 1
    assert steps * 2 <= 3 * window  # passed within a few windows ...
    assert unaged.num_uses[0, 2] < unaged.num_uses[0, 0]  # ... where the unaged counts still favour the past
