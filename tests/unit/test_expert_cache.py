"""The engine's expert cache (`elasticmoe.engine.expert_cache`): rows, residency and the two
threads that load them, with a fake tier whose every expert has recognisable weights."""

from __future__ import annotations

import contextlib
import random
import threading
import time
from collections.abc import Iterator

import pytest
import torch

from elasticmoe.engine.expert_cache import ExpertCache
from elasticmoe.offload.cache_ops import CacheTooSmallError
from elasticmoe.offload.policy import PolicyConfig, PrefetchItem, PrefetchPlan
from elasticmoe.offload.registry import make_policy

LAYERS, EXPERTS, TOP_K = 3, 6, 2


class FakeTier:
    """Expert (layer, local) has every weight equal to layer * 100 + local; optionally slow or failing."""

    tier = "disk"

    def __init__(self, delay_s: float = 0.0, failing: set[tuple[int, int]] | None = None) -> None:
        self.delay_s, self.failing = delay_s, failing or set()
        self.copies = 0

    def copy_into(self, layer, local, w13, w2) -> int:
        if (layer, local) in self.failing:
            raise OSError(f"expert {layer}/{local}: unreadable")
        if self.delay_s:
            time.sleep(self.delay_s)
        w13.fill_(layer * 100 + local)
        w2.fill_(layer * 100 + local)
        self.copies += 1
        return w13.nbytes + w2.nbytes


def make_cache(capacity: int, policy: str = "lru", tier: FakeTier | None = None,
               local_ids: tuple[int, ...] = tuple(range(EXPERTS))) -> ExpertCache:
    config = PolicyConfig(num_layers=LAYERS, num_experts=EXPERTS, top_k=TOP_K)
    return ExpertCache(make_policy(policy, config), tier or FakeTier(), torch.zeros(capacity, 4, 2),
                       torch.zeros(capacity, 2, 2), local_ids, LAYERS, EXPERTS)


def assert_rows_hold(cache: ExpertCache, layer: int, experts: list[int], rows: list[int]) -> None:
    for expert, row in zip(experts, rows, strict=True):
        want = layer * 100 + cache.local_of[expert]
        assert cache.w13[row].eq(want).all() and cache.w2[row].eq(want).all(), (layer, expert, row)


def test_ensure_loads_missing_experts_and_evicts_within_the_budget():
    cache = make_cache(capacity=3)
    rows = cache.ensure(0, [1, 4])
    assert_rows_hold(cache, 0, [1, 4], rows)
    rows = cache.ensure(1, [2, 3])  # one of layer 0's experts leaves
    assert_rows_hold(cache, 1, [2, 3], rows)
    assert cache.state.num_resident == 3
    stats = cache.stats()
    assert stats["on_demand_loads"] == 4 and stats["evictions"] == 1 and stats["hits"] == 0
    assert stats["bytes_loaded_disk"] == 4 * cache.expert_bytes
    assert cache.ensure(1, [3]) == [rows[1]]  # resident: a hit, no copy
    assert cache.stats()["hits"] == 1
    cache.check_integrity()


def test_a_layer_needing_more_experts_than_the_cache_raises_and_keeps_the_cache_consistent():
    cache = make_cache(capacity=2)
    cache.ensure(0, [0])
    with pytest.raises(CacheTooSmallError):
        cache.ensure(0, [1, 2, 3])
    cache.check_integrity()
    assert_rows_hold(cache, 1, [5], cache.ensure(1, [5]))  # the cache still works


def test_a_failed_load_leaves_the_expert_absent_and_its_row_free():
    tier = FakeTier(failing={(0, 2)})
    cache = make_cache(capacity=2, tier=tier)
    with pytest.raises(OSError):
        cache.ensure(0, [1, 2])
    cache.check_integrity()
    assert cache.state.num_resident == 0 and not cache.state.is_resident((0, 2))
    tier.failing.clear()
    assert_rows_hold(cache, 0, [1, 2], cache.ensure(0, [1, 2]))
    cache.check_integrity()


def test_prefetch_copies_the_plan_and_counts_useful_and_wasted():
    cache = make_cache(capacity=2)
    with cache.locked():
        cache._plan = PrefetchPlan(-1, (PrefetchItem(0, 3, 0.9), PrefetchItem(1, 5, 0.5)))
    assert cache.prefetch_once() and cache.prefetch_once()
    assert cache.stats()["prefetches"] == 2
    assert_rows_hold(cache, 0, [3], cache.ensure(0, [3]))  # a hit, prefetched: useful
    cache.ensure(2, [0])  # evicts (1, 5), never used: wasted
    stats = cache.stats()
    assert (stats["hits"], stats["prefetches_useful"], stats["prefetches_wasted"]) == (1, 1, 1)
    cache.check_integrity()


def test_a_failed_prefetch_is_counted_and_the_forward_loads_on_demand():
    tier = FakeTier(failing={(1, 4)})
    cache = make_cache(capacity=2, tier=tier)
    with cache.locked():
        cache._plan = PrefetchPlan(0, (PrefetchItem(1, 4, 1.0),))
    assert cache.prefetch_once()
    assert cache.stats()["prefetch_failures"] == 1 and not cache.state.is_resident((1, 4))
    cache.check_integrity()
    tier.failing.clear()
    assert_rows_hold(cache, 1, [4], cache.ensure(1, [4]))


def test_prefetch_skips_experts_another_rank_holds():
    cache = make_cache(capacity=2, local_ids=(3, 4, 5))  # EP: this rank holds experts 3-5
    with cache.locked():
        cache._plan = PrefetchPlan(-1, (PrefetchItem(0, 1, 0.9), PrefetchItem(0, 4, 0.5)))
    assert cache.prefetch_once()
    assert cache.state.resident_keys() == [(0, 4)]
    assert_rows_hold(cache, 0, [4], cache.ensure(0, [4]))


def test_a_prefetch_never_evicts_what_the_layers_router_just_chose():
    """Between a layer's router and its `ensure`, the experts it routed to are no prefetch's
    victims: LRU would pick (0, 0) first, used longest ago, though layer 0 asks for it next."""
    cache = make_cache(capacity=2)
    cache.ensure(0, [0])
    cache.ensure(1, [1])
    cache.replan(routed=(0, [0]))  # the next iteration's layer 0 routed to expert 0
    with cache.locked():
        cache._plan = PrefetchPlan(0, (PrefetchItem(1, 2, 1.0),))
    assert cache.prefetch_once()
    assert cache.state.resident_keys() == [(0, 0), (1, 2)]  # (1, 1) went instead
    assert cache.ensure(0, [0]) and cache.stats()["on_demand_loads"] == 2  # a hit
    cache.check_integrity()


class BlockingTier(FakeTier):
    """A tier whose copies of `blocked` wait for `release` (a prefetch caught mid-copy)."""

    def __init__(self, blocked: tuple[int, int]) -> None:
        super().__init__()
        self.blocked, self.started, self.release = blocked, threading.Event(), threading.Event()

    def copy_into(self, layer, local, w13, w2) -> int:
        if (layer, local) == self.blocked:
            self.started.set()
            assert self.release.wait(timeout=3)
        return super().copy_into(layer, local, w13, w2)


@contextlib.contextmanager
def blocked_prefetch(cache: ExpertCache, tier: BlockingTier,
                     release_after_s: float | None = None) -> Iterator[None]:
    """A prefetch of `tier.blocked`, mid-copy inside the block (its copy released `release_after_s`
    into it, or at its end), complete after it."""
    with cache.locked():
        cache._plan = PrefetchPlan(0, (PrefetchItem(*tier.blocked, 1.0),))
    prefetch = threading.Thread(target=cache.prefetch_once)
    prefetch.start()
    assert tier.started.wait(timeout=5)
    if release_after_s is not None:
        threading.Timer(release_after_s, tier.release.set).start()
    try:
        yield
    finally:
        tier.release.set()
        prefetch.join(timeout=5)


def test_a_hit_does_not_wait_for_a_prefetch_copy_of_another_expert():
    tier = BlockingTier(blocked=(1, 5))
    cache = make_cache(capacity=3, tier=tier)
    rows = cache.ensure(0, [0, 1])
    with blocked_prefetch(cache, tier):
        # (1, 5) is being copied; the forward's resident experts come back at once, with their rows
        assert cache.ensure(0, [0, 1]) == rows
        with cache.locked():
            assert cache._in_flight == (1, 5)  # still copying: the lookup did not wait for it
        assert cache.stats()["hits"] == 2 and cache.stats()["waits_for_prefetch"] == 0
    assert_rows_hold(cache, 1, [5], cache.ensure(1, [5]))  # the prefetch completed: a hit
    cache.check_integrity()


def test_a_lookup_of_the_expert_being_prefetched_waits_for_its_copy():
    tier = BlockingTier(blocked=(1, 5))
    cache = make_cache(capacity=3, tier=tier)
    with blocked_prefetch(cache, tier, release_after_s=0.2):
        rows = cache.ensure(1, [5])  # not published yet: waits, then finds it resident
    assert_rows_hold(cache, 1, [5], rows)
    assert cache.stats()["waits_for_prefetch"] == 1 and cache.stats()["on_demand_loads"] == 0
    cache.check_integrity()


def test_an_on_demand_load_runs_beside_a_prefetch_copy_and_never_evicts_it():
    tier = BlockingTier(blocked=(1, 5))
    cache = make_cache(capacity=3, tier=tier)
    cache.ensure(0, [0, 1])
    with blocked_prefetch(cache, tier):  # the third row is being written
        rows = cache.ensure(2, [3])  # a miss with no free row: a victim other than (1, 5), no wait
        assert_rows_hold(cache, 2, [3], rows)
        with cache.locked():
            assert cache._in_flight == (1, 5)  # still copying
            assert cache.state.is_resident((1, 5)) and cache.state.num_resident == 3
        assert cache.stats()["on_demand_loads"] == 3 and cache.stats()["waits_for_prefetch"] == 0
    assert_rows_hold(cache, 1, [5], cache.ensure(1, [5]))  # the prefetch landed: a hit
    cache.check_integrity()


def test_a_load_that_needs_the_row_being_written_waits_for_the_copy():
    tier = BlockingTier(blocked=(1, 5))
    cache = make_cache(capacity=2, tier=tier)
    cache.ensure(0, [0])
    with blocked_prefetch(cache, tier, release_after_s=0.2):
        rows = cache.ensure(2, [3, 4])  # needs both rows: (0, 0)'s and, once copied, (1, 5)'s
    assert_rows_hold(cache, 2, [3, 4], rows)
    assert not cache.state.is_resident((1, 5)) and cache.stats()["prefetches_wasted"] == 1
    cache.check_integrity()


def test_close_wakes_an_idle_prefetch_thread():
    cache = make_cache(capacity=2)
    results = []
    thread = threading.Thread(target=lambda: results.append(cache.prefetch_once()))
    thread.start()
    cache.close()
    thread.join(timeout=5)
    assert not thread.is_alive() and results == [False]


@pytest.mark.parametrize("policy", ["lru", "finemoe"])
def test_forward_and_prefetch_threads_never_hand_out_a_wrong_row(policy):
    """A slow prefetcher copies random plans while the forward thread asks for random experts:
    every row the forward gets holds the expert it asked for, and the cache stays consistent."""
    tier = FakeTier(delay_s=0.0005)
    cache = make_cache(capacity=4, policy=policy, tier=tier)
    stop = threading.Event()

    def prefetcher() -> None:
        while not stop.is_set() and cache.prefetch_once():
            pass

    thread = threading.Thread(target=prefetcher)
    thread.start()
    rng = random.Random(0)
    try:
        for _ in range(300):
            layer = rng.randrange(LAYERS)
            experts = rng.sample(range(EXPERTS), rng.randint(1, TOP_K))
            rows = cache.ensure(layer, experts)
            assert_rows_hold(cache, layer, experts, rows)
            plan_layer = rng.randrange(LAYERS)
            items = tuple(PrefetchItem(plan_layer, e, 1.0 - i / 10) for i, e in enumerate(rng.sample(range(EXPERTS), 3)))
            with cache.locked():
                cache._plan = PrefetchPlan(plan_layer - 1, items)
                cache.locked().notify_all()
            if rng.random() < 0.3:
                time.sleep(0.002)  # let the prefetcher start a copy before the forward asks again
            cache.check_integrity()
    finally:
        stop.set()
        cache.close()
        thread.join(timeout=5)
    stats = cache.stats()
    assert stats["prefetches"] > 0 and stats["resident_experts"] <= 4
    assert stats["lookups"] == stats["hits"] + stats["on_demand_loads"]


def test_warm_fills_the_most_used_local_experts_first():
    popularity = torch.zeros(LAYERS, EXPERTS, dtype=torch.long).numpy()
    popularity[1, 3], popularity[0, 0], popularity[2, 5], popularity[0, 4], popularity[1, 2] = 9, 7, 5, 3, 1
    fresh = make_cache(capacity=3, local_ids=(0, 1, 3, 4))  # expert 5 lives on another rank
    assert fresh.warm(popularity) == 3
    assert sorted(fresh.state.resident_keys()) == [(0, 0), (0, 4), (1, 3)]  # (2, 5) is not local
    for layer, expert in fresh.state.resident_keys():
        assert_rows_hold(fresh, layer, [expert], [int(fresh.slot_of[layer, expert])])
    assert fresh.stats()["warm_loads"] == 3 and fresh.warm(popularity) == 0  # full: nothing more
    fresh.check_integrity()
    with pytest.raises(ValueError, match="popularity"):
        fresh.warm(popularity[:1])


def test_a_failed_warm_copy_leaves_that_expert_out_and_the_cache_consistent():
    popularity = torch.zeros(LAYERS, EXPERTS, dtype=torch.long).numpy()
    popularity[0, 1], popularity[0, 2] = 5, 4
    cache = make_cache(capacity=3, tier=FakeTier(failing={(0, 1)}))
    assert cache.warm(popularity) == 1
    assert cache.state.resident_keys() == [(0, 2)] and cache.state.num_free == 2
    cache.check_integrity()
