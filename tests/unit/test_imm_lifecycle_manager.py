"""Instance state machine and the InstanceManager's LRU standby pool, without Ray."""

from __future__ import annotations

import itertools
import threading

import pytest

from imm.lifecycle import IllegalTransition, InstanceState, can_transition, check_transition
from imm.manager import InstanceManager

S = InstanceState
HAPPY_PATH = [S.BOOTING, S.STANDBY, S.ATTACHED, S.WARM, S.ACTIVE, S.DRAINING, S.RETIRED]


def test_happy_path_is_legal():
    for a, b in itertools.pairwise(HAPPY_PATH):
        check_transition(a, b)


@pytest.mark.parametrize("state", [s for s in S if s is not S.RETIRED])
def test_any_live_state_can_retire(state):
    assert can_transition(state, S.RETIRED)


def test_everything_else_raises():
    rollback = {(S.DRAINING, S.ACTIVE)}  # a paused instance whose switchover failed serves again
    legal = set(itertools.pairwise(HAPPY_PATH)) | {(s, S.RETIRED) for s in S if s is not S.RETIRED} | rollback
    for a, b in itertools.product(S, S):
        if (a, b) in legal:
            continue
        with pytest.raises(IllegalTransition, match=f"from {a.value} to {b.value}"):
            check_transition(a, b)


class FakeInstance:
    def __init__(self, dp: int) -> None:
        self.dp, self.state = dp, S.STANDBY

    def retire(self) -> None:
        check_transition(self.state, S.RETIRED)
        self.state = S.RETIRED


def make_manager(capacity: int = 2) -> tuple[InstanceManager, list[FakeInstance]]:
    created: list[FakeInstance] = []

    def factory(dp: int) -> FakeInstance:
        created.append(FakeInstance(dp))
        return created[-1]

    return InstanceManager(factory, capacity), created


def test_lru_evicts_least_recently_used():
    mgr, created = make_manager(capacity=2)
    mgr.prepare([1, 2])
    mgr.prepare([1])  # touch dp=1: dp=2 is now the oldest
    mgr.prepare([3])
    assert list(mgr.pool) == [1, 3] and mgr.num_evictions == 1
    assert [i.state for i in created] == [S.STANDBY, S.RETIRED, S.STANDBY]
    assert len(created) == 3  # the touch did not boot a second dp=1


def test_take_hits_then_misses():
    mgr, created = make_manager()
    mgr.prepare([2])
    inst = mgr.take(2)
    assert inst is created[0] and 2 not in mgr.pool and mgr.num_hits == 1
    fresh = mgr.take(2)
    assert fresh is created[1] and mgr.num_misses == 1
    mgr.prepare([3, 4, 5])  # eviction never touches instances handed out
    assert inst.state is S.STANDBY and fresh.state is S.STANDBY


def test_a_pooled_instance_that_does_not_fit_is_retired_and_replaced():
    """A standby placed for another layout (its ranks on other nodes) is never handed out."""
    mgr, created = make_manager()
    mgr.prepare([2])
    fresh = mgr.take(2, fits=lambda inst: inst is not created[0])
    assert fresh is created[1] and created[0].state is S.RETIRED and mgr.num_misses == 1 and mgr.num_hits == 0
    mgr.prepare([2])
    assert mgr.take(2, fits=lambda inst: True) is created[2] and mgr.num_hits == 1


def test_zero_capacity_keeps_nothing():
    mgr, created = make_manager(capacity=0)
    mgr.prepare([2])
    assert not mgr.pool and created[0].state is S.RETIRED


def test_take_waits_for_the_background_boot_of_its_dp_only():
    booting, release = threading.Event(), threading.Event()
    created: list[FakeInstance] = []

    def slow_factory(dp: int) -> FakeInstance:
        inst = FakeInstance(dp)
        created.append(inst)
        if dp == 2:  # the background preparation's boot
            booting.set()
            assert release.wait(5)
        return inst

    mgr = InstanceManager(slow_factory, capacity=2)
    prep = threading.Thread(target=mgr.prepare, args=([2],))
    prep.start()
    assert booting.wait(5)
    other = mgr.take(3)  # another dp: boots its own at once, not behind the lock
    assert other.dp == 3 and mgr.num_misses == 1
    taker = threading.Thread(target=lambda: taken.append(mgr.take(2)))
    taken: list[FakeInstance] = []
    taker.start()
    taker.join(0.2)
    assert taker.is_alive()  # waits for the boot in progress instead of booting a second dp=2
    release.set()
    prep.join(5)
    taker.join(5)
    assert taken == [created[0]] and mgr.num_hits == 1 and len(created) == 2 and not mgr.pool


def test_a_boot_that_finishes_after_shutdown_is_retired():
    booting, release = threading.Event(), threading.Event()
    created: list[FakeInstance] = []

    def slow_factory(dp: int) -> FakeInstance:
        inst = FakeInstance(dp)
        created.append(inst)
        booting.set()
        assert release.wait(5)
        return inst

    mgr = InstanceManager(slow_factory)
    prep = threading.Thread(target=mgr.prepare, args=([1, 3],))
    prep.start()
    assert booting.wait(5)
    mgr.shutdown()
    release.set()
    prep.join(5)
    assert not mgr.pool and [i.state for i in created] == [S.RETIRED]  # dp=3 never booted
