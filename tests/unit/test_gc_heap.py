"""The startup heap frozen out of the collector's full passes, and given back before an engine goes."""

import gc
import weakref

import pytest

from elasticmoe.utils.gc_heap import freeze_startup_heap, thaw_heap


class Cycle:
    """Unreachable, only the collector frees it (its reference count never falls to zero)."""

    def __init__(self) -> None:
        self.me = self


@pytest.fixture(autouse=True)
def _thawed():
    yield
    gc.unfreeze()  # the test process's heap does not stay frozen


def test_the_start_garbage_is_collected_before_the_freeze():
    garbage = Cycle()
    gone = weakref.ref(garbage)
    del garbage
    assert freeze_startup_heap("test") > 0
    assert gone() is None  # frozen, it would have stayed for good


def test_a_frozen_cycle_is_collected_only_once_thawed():
    engine = Cycle()
    ref = weakref.ref(engine)
    freeze_startup_heap("test")
    del engine
    gc.collect()
    assert ref() is not None  # out of the collector's sight while frozen
    thaw_heap()
    gc.collect()
    assert ref() is None
