"""The engine's expert cache (`elasticmoe.engine.expert_cache`): rows, residency, the queue of
prefetch copies and the copiers that make them, with tiers whose every expert has recognisable
weights. Most tests drive the Python copier a copy at a time (`run_one`); the concurrent ones run
the Python thread and the native copy engine."""

from __future__ import annotations

import contextlib
import random
import threading
import time
from collections.abc import Iterator

import pytest
import torch

from elasticmoe.engine.expert_cache import ExpertCache
from elasticmoe.engine.expert_copier import NativeCopier, ThreadCopier, make_copier
from elasticmoe.engine.expert_sources import HostExperts
from elasticmoe.kernels import copy_engine
from elasticmoe.kernels.copy_engine import FIRST_HALF, WHOLE
from elasticmoe.offload.cache_ops import CacheTooSmallError
from elasticmoe.offload.lru import OnDemandPolicy
from elasticmoe.offload.policy import PolicyConfig, PrefetchItem, PrefetchPlan
from elasticmoe.offload.registry import make_policy

LAYERS, EXPERTS, TOP_K = 3, 6, 2
POLL_US = 2000
needs_copy_engine = pytest.mark.skipif(not copy_engine.available(), reason="no C++ compiler for the copy engine")


class FakeTier:
    """Expert (layer, local) has every weight equal to layer * 100 + local; optionally slow or failing."""

    tier = "disk"
    drops_pages = False

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


    def segments(self, layer, local, dtype):
        return None  # copied by `copy_into` only: the Python copier


def host_tier(local_ids: tuple[int, ...], row: tuple[int, int] = (4, 2)) -> HostExperts:
    """FakeTier's weights in host memory, which the native copier can copy."""
    stacks = []
    for layer in range(LAYERS):
        values = torch.tensor([layer * 100 + local for local in range(len(local_ids))], dtype=torch.float32)
        stacks.append((values.view(-1, 1, 1).expand(-1, *row).contiguous(),
                       values.view(-1, 1, 1).expand(-1, row[1], row[1]).contiguous()))
    return HostExperts(stacks)


def make_cache(capacity: int, policy: str = "lru", tier: FakeTier | HostExperts | None = None,
               local_ids: tuple[int, ...] = tuple(range(EXPERTS)), copier: str = "manual",
               row: tuple[int, int] = (4, 2)) -> ExpertCache:
    """`copier`: "manual" (the Python copier without its thread: `cache.copier.run_one()` copies),
    "thread" (with it), "native" (the copy engine; needs a `HostExperts` tier), or "native-polling"
    (its thread polls, so on-demand loads give it half of their copies)."""
    # one LRU order over every layer: these tests name victims by age alone (the per-layer shares
    # are tested in test_offload_policies.py)
    config = PolicyConfig(num_layers=LAYERS, num_experts=EXPERTS, top_k=TOP_K, lru_per_layer=False)
    tier = tier or FakeTier()
    w13, w2 = torch.zeros(capacity, *row), torch.zeros(capacity, row[1], row[1])
    made = (ThreadCopier(tier, w13, w2, start=copier == "thread") if copier in ("manual", "thread")
            else make_copier(tier, w13, w2, LAYERS, len(local_ids), poll_us=POLL_US if copier == "native-polling" else 0))
    if copier.startswith("native"):
        assert isinstance(made, NativeCopier)
    return ExpertCache(make_policy(policy, config), tier, w13, w2, local_ids, LAYERS, EXPERTS, copier=made)


def queue_plan(cache: ExpertCache, after_layer: int, *items: tuple[int, int, float]) -> None:
    """Queue a prefetch plan of (layer, expert, priority) items, as `replan` does with the policy's."""
    with cache.locked():
        cache._plan = PrefetchPlan(after_layer, tuple(PrefetchItem(*item) for item in items))
        cache._queue_plan()


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
    assert cache.ensure(1, []) == [] and cache.stats()["lookups"] == 5  # nothing asked, nothing counted
    cache.check_integrity()


def test_hits_count_in_the_usage_before_anything_reads_it():
    """A hit's visit is applied when the usage is next read (a victim choice, `state`), not at once:
    the snapshot is the one of applying each lookup in turn, and LRU's victim is the expert hit
    longest ago, not the one loaded longest ago. Unread hits are applied at least once per
    iteration's worth of layers (a cache without a policy reads no usage)."""
    cache = make_cache(capacity=3)
    for layer, experts in ((0, [0]), (0, [1]), (1, [2])):
        cache.ensure(layer, experts)  # loads
    hits = [(0, [0]), (1, [2])]
    for layer, experts in hits:
        cache.ensure(layer, experts)
    assert len(cache._hits) == 2
    want = cache._state
    for layer, experts in hits:
        want = want.use(layer, experts)
    for name in ("last_used", "num_uses"):
        assert getattr(cache.state, name).tolist() == getattr(want, name).tolist(), name
    assert cache.state.clock == want.clock and not cache._hits
    for layer, experts in hits:
        cache.ensure(layer, experts)
    cache.ensure(2, [3])  # a miss: its victim is chosen on the usage with those hits
    assert cache.state.resident_keys() == [(0, 0), (1, 2), (2, 3)]  # (0, 1) was used longest ago
    for _ in range(10):
        cache.ensure(0, [0])
        assert len(cache._hits) < LAYERS
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
    queue_plan(cache, -1, (0, 3, 0.9), (1, 5, 0.5))
    assert cache.copier.run_one() and cache.copier.run_one() and not cache.copier.run_one()
    assert cache.stats()["prefetches"] == 2  # published when read
    assert_rows_hold(cache, 0, [3], cache.ensure(0, [3]))  # a hit, prefetched: useful
    cache.ensure(2, [0])  # evicts (1, 5), never used: wasted
    stats = cache.stats()
    assert (stats["hits"], stats["prefetches_useful"], stats["prefetches_wasted"]) == (1, 1, 1)
    cache.check_integrity()


def test_a_failed_prefetch_is_counted_and_the_forward_loads_on_demand():
    tier = FakeTier(failing={(1, 4)})
    cache = make_cache(capacity=2, tier=tier)
    queue_plan(cache, 0, (1, 4, 1.0))
    assert cache.copier.run_one()
    assert cache.stats()["prefetch_failures"] == 1 and not cache.state.is_resident((1, 4))
    cache.check_integrity()
    tier.failing.clear()
    assert_rows_hold(cache, 1, [4], cache.ensure(1, [4]))


def test_prefetch_skips_experts_another_rank_holds():
    cache = make_cache(capacity=2, local_ids=(3, 4, 5))  # EP: this rank holds experts 3-5
    queue_plan(cache, -1, (0, 1, 0.9), (0, 4, 0.5))
    assert cache.copier.run_one() and not cache.copier.run_one()
    assert cache.state.resident_keys() == [(0, 4)]
    assert_rows_hold(cache, 0, [4], cache.ensure(0, [4]))


def test_a_prefetch_never_evicts_what_the_last_ensure_computes_with():
    """A plan comes after its layer's `ensure` (`ExpertOffload` defers it there), whose experts are
    no prefetch's victims: LRU would pick (0, 0) first, used longest ago."""
    cache = make_cache(capacity=2)
    cache.ensure(1, [1])
    cache.ensure(0, [0])  # the next iteration's layer 0
    cache.state = cache.state.use(1, [1])  # (1, 1) now the more recently used: LRU's victim is (0, 0)
    queue_plan(cache, 0, (1, 2, 1.0))
    assert cache.copier.run_one()
    assert cache.state.resident_keys() == [(0, 0), (1, 2)]  # (1, 1) went instead
    assert cache.ensure(0, [0]) and cache.stats()["on_demand_loads"] == 2  # a hit
    cache.check_integrity()


def test_a_cancelled_copy_gives_its_victim_back_its_row_and_stamps():
    """A newer plan that no longer wants a queued copy cancels it before it starts: the victim's row
    was never written, so the victim is resident again, in the same row, as old as it was (LRU
    still evicts it first), and a lookup of it is a hit."""
    cache = make_cache(capacity=2)
    rows = {0: cache.ensure(0, [0])[0], 1: cache.ensure(1, [1])[0]}
    queue_plan(cache, 1, (2, 2, 1.0))  # victim: (0, 0), the least recently used
    with cache.locked():
        assert cache.slot_of[0, 0] == -1 and cache.state.is_resident((2, 2))  # its row is promised
    queue_plan(cache, 1)  # the plan changed before the copy started: nothing to prefetch now
    assert cache.stats()["prefetches_cancelled"] == 1
    with cache.locked():
        assert cache.state.is_resident((0, 0)) and int(cache.slot_of[0, 0]) == rows[0]
    cache.check_integrity()
    queue_plan(cache, 1, (2, 3, 1.0))  # (0, 0) is still the oldest: reinstated, not stamped as new
    assert cache.copier.run_one()
    assert cache.state.resident_keys() == [(1, 1), (2, 3)]
    assert cache.ensure(2, [3]) == [rows[0]] and cache.ensure(1, [1]) == [rows[1]]  # two hits
    assert cache.stats()["on_demand_loads"] == 2
    cache.check_integrity()


def test_a_lookup_of_a_queued_copys_victim_cancels_the_queue_and_hits():
    cache = make_cache(capacity=2)
    row = cache.ensure(0, [0])[0]
    cache.ensure(1, [1])
    queue_plan(cache, 1, (2, 2, 1.0))  # victim (0, 0), not copied yet
    assert cache.ensure(0, [0]) == [row]  # the copy is cancelled: (0, 0) never left its row
    stats = cache.stats()
    assert (stats["hits"], stats["on_demand_loads"], stats["prefetches_cancelled"]) == (1, 2, 1)
    assert cache.state.resident_keys() == [(0, 0), (2, 2)]  # the plan queued again, another victim
    assert cache.copier.run_one()
    assert_rows_hold(cache, 2, [2], cache.ensure(2, [2]))
    cache.check_integrity()


def test_a_lookup_of_a_queued_expert_loads_it_now_instead_of_after_the_queue():
    cache = make_cache(capacity=3)
    queue_plan(cache, -1, (1, 1, 0.9), (2, 2, 0.5))
    assert_rows_hold(cache, 2, [2], cache.ensure(2, [2]))  # the queue is not run first
    stats = cache.stats()
    assert (stats["on_demand_loads"], stats["waits_for_prefetch"], stats["prefetches_cancelled"]) == (1, 0, 2)
    assert cache.copier.run_one() and not cache.copier.run_one()  # (1, 1) queued again
    assert_rows_hold(cache, 1, [1], cache.ensure(1, [1]))
    cache.check_integrity()


def test_a_newer_plan_that_still_wants_the_queue_keeps_it():
    cache = make_cache(capacity=3)
    queue_plan(cache, -1, (1, 1, 0.9))
    queue_plan(cache, 0, (1, 1, 0.9), (2, 2, 0.5))  # the next layer's plan: one more
    assert cache.stats()["prefetches_cancelled"] == 0
    assert cache.copier.run_one() and cache.copier.run_one() and not cache.copier.run_one()
    assert cache.stats()["prefetches"] == 2
    cache.check_integrity()


class FixedPlanPolicy(OnDemandPolicy):
    """LRU victims; plans `wanted` minus what the cache holds, as every policy leaves out the
    resident experts."""

    name = "fixed"

    def __init__(self, wanted: list[tuple[int, int]]) -> None:
        super().__init__(PolicyConfig(num_layers=LAYERS, num_experts=EXPERTS, top_k=TOP_K, lru_per_layer=False))
        self.wanted = wanted

    def prefetch_plan(self, cache):
        keys = [key for key in self.wanted if not cache.is_resident(key)]
        return PrefetchPlan(-1, tuple(PrefetchItem(*key, 1.0 - i / 10) for i, key in enumerate(keys)))


def test_replanning_the_same_plan_keeps_its_queued_copies():
    """The policy is shown the queued copies' experts as not resident: otherwise the plan after
    the next layer would leave them out, and the copies it still wants would be cancelled."""
    tier = FakeTier()
    w13, w2 = torch.zeros(3, 4, 2), torch.zeros(3, 2, 2)
    cache = ExpertCache(FixedPlanPolicy([(1, 1), (2, 2)]), tier, w13, w2, tuple(range(EXPERTS)), LAYERS,
                        EXPERTS, copier=ThreadCopier(tier, w13, w2, start=False))
    cache.replan()
    cache.replan()  # the next layer: the same plan
    assert cache.stats()["prefetches_cancelled"] == 0
    assert cache.copier.run_one() and cache.copier.run_one() and not cache.copier.run_one()
    assert_rows_hold(cache, 2, [2], cache.ensure(2, [2]))
    assert cache.stats()["prefetches"] == 2 and cache.stats()["on_demand_loads"] == 0
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
    queue_plan(cache, 0, (*tier.blocked, 1.0))
    prefetch = threading.Thread(target=cache.copier.run_one)
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
        assert cache.copier.running() >= 0  # still copying: the lookup did not wait for it
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
        assert cache.copier.running() >= 0  # still copying
        with cache.locked():
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


def test_the_python_copiers_halves_of_an_expert_make_the_whole():
    """The Python copier (no native engine) shares a load as the native one does: its queued second
    half and the caller's first half write the row exactly, and a first half alone only its bytes."""
    row = (64, 32)  # 12 KiB: the halves meet inside w13's part of the row
    tier = host_tier(tuple(range(EXPERTS)), row)
    w13, w2 = torch.zeros(3, *row), torch.zeros(3, row[1], row[1])
    copier = ThreadCopier(tier, w13, w2, start=False)
    second = copier.submit_second_half((1, 2, 0))
    assert copier.copy_now((1, 2, 0), FIRST_HALF) and copier.run_one() and copier.finished() == second + 1
    assert w13[0].eq(102).all() and w2[0].eq(102).all()
    copier.copy_now((0, 3, 1), FIRST_HALF)
    lo, hi = copy_engine.part_bounds(w13[1].nbytes + w2[1].nbytes, FIRST_HALF)
    assert lo == 0 and w13[1].view(-1)[: hi // 4].eq(3).all() and not w13[1].view(-1)[hi // 4 :].any()


def test_close_stops_an_idle_copier_thread_and_drops_the_queue():
    cache = make_cache(capacity=2, copier="thread")
    cache.copier.pause(True)
    queue_plan(cache, -1, (0, 1, 1.0))
    cache.close()
    assert not cache.copier._thread.is_alive()
    assert cache.state.num_resident == 0 and cache.stats()["prefetches_cancelled"] == 1
    cache.check_integrity()


@pytest.mark.skipif(not copy_engine.available(), reason="no C++ compiler for the copy engine")
def test_a_closed_cache_still_loads_on_demand_and_queues_nothing():
    """A step that races the engine's shutdown must not fail on the stopped copier."""
    cache = make_cache(capacity=2, tier=host_tier(tuple(range(EXPERTS))), copier="native")
    cache.close()
    assert_rows_hold(cache, 1, [2, 3], cache.ensure(1, [2, 3]))
    queue_plan(cache, 1, (2, 2, 1.0))
    assert cache.stats()["prefetches"] == 0 and cache.state.resident_keys() == [(1, 2), (1, 3)]


@pytest.mark.parametrize("copier", ["thread", pytest.param("native", marks=needs_copy_engine),
                                    pytest.param("native-polling", marks=needs_copy_engine)])
@pytest.mark.parametrize("policy", ["lru", "finemoe"])
def test_forward_and_copier_never_hand_out_a_wrong_row(policy, copier):
    """The copier copies random plans while the forward thread asks for random experts: every row
    the forward gets holds the expert it asked for, and the cache stays consistent."""
    if copier == "thread":
        cache = make_cache(capacity=4, policy=policy, tier=FakeTier(delay_s=0.0005), copier="thread")
    else:  # rows of 256 KiB: copies long enough to be caught in progress
        cache = make_cache(capacity=4, policy=policy, tier=host_tier(tuple(range(EXPERTS)), row=(256, 128)),
                           copier=copier, row=(256, 128))
    rng = random.Random(0)
    try:
        for _ in range(300):
            layer = rng.randrange(LAYERS)
            experts = rng.sample(range(EXPERTS), rng.randint(1, TOP_K))
            rows = cache.ensure(layer, experts)
            assert_rows_hold(cache, layer, experts, rows)
            plan_layer = rng.randrange(LAYERS)
            queue_plan(cache, plan_layer - 1, *((plan_layer, e, 1.0 - i / 10)
                                                for i, e in enumerate(rng.sample(range(EXPERTS), 3))))
            if rng.random() < 0.3:
                time.sleep(0.002)  # let the copier start a copy before the forward asks again
            cache.check_integrity()
    finally:
        cache.close()
    stats = cache.stats()
    assert stats["prefetches"] > 0 and stats["resident_experts"] <= 4
    assert stats["lookups"] == stats["hits"] + stats["on_demand_loads"]


@needs_copy_engine
def test_an_on_demand_load_gives_half_its_copies_to_a_polling_copier():
    row = (64, 32)  # 12 KiB experts: a half ends inside w13's part of the row
    cache = make_cache(capacity=4, tier=host_tier(tuple(range(EXPERTS)), row), copier="native-polling", row=row)
    try:
        rows = cache.ensure(1, [2, 4, 5])
        assert_rows_hold(cache, 1, [2, 4, 5], rows)
        assert cache.copier.finished() == 2  # the copier made the last and half the middle one, this thread the rest
        assert cache.stats()["on_demand_loads"] == 3 and cache.bytes_loaded["host"] == 3 * cache.expert_bytes
        rows = cache.ensure(0, [3])  # one expert alone: split in halves
        assert_rows_hold(cache, 0, [3], rows)
        assert cache.copier.finished() == 3 and cache.bytes_loaded["host"] == 4 * cache.expert_bytes
        cache.check_integrity()
    finally:
        cache.close()


@needs_copy_engine
def test_a_shared_load_whose_own_copy_fails_waits_for_the_copiers_and_frees_both_rows():
    """This thread's copy raises while the copier writes the other row: the load fails only once
    the copier is done with that row, and both experts are left out with their rows free."""
    row = (1024, 512)  # 3 MiB experts: the copier's copy outlasts this thread's failed one by far
    cache = make_cache(capacity=4, tier=host_tier(tuple(range(EXPERTS)), row), copier="native-polling", row=row)
    own_copy = cache.copier.copy_now

    def failing(copy, part=WHOLE):  # this thread's copies of expert 1 of layer 0 fail
        if copy[:2] == (0, 1):
            raise OSError("expert 0/1: unreadable")
        return own_copy(copy, part)

    cache.copier.copy_now = failing
    try:
        with pytest.raises(OSError, match="unreadable"):
            cache.ensure(0, [1, 3])  # this thread copies 1 (fails), the copier 3
        assert cache.copier.finished() == 1 and cache.copier.running() == -1
        assert not cache.state.is_resident((0, 1)) and not cache.state.is_resident((0, 3))
        assert cache.state.num_free == 4 and sorted(cache._free) == [0, 1, 2, 3]
        cache.check_integrity()
        rows = cache.ensure(0, [3, 4])  # the cache serves on
        assert_rows_hold(cache, 0, [3, 4], rows)
    finally:
        cache.close()


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
