"""A scale's start: a manual scale waits out a short adapter step (a swap or a registration
holds the adapter lock for a moment), a caller that may not block (the autoscaler on the event
loop) gets its 409 at once, a lock held too long is a 409, and so is a scale asked for while
another one switches over."""

import threading
from types import SimpleNamespace

import pytest

from coordinator.scale_events import ScaleConflict, ScaleEvents
from coordinator.scaler import Scaler


def _cluster() -> SimpleNamespace:
    adapters = SimpleNamespace(lock=threading.Lock(), busy_reason=lambda: None)
    return SimpleNamespace(
        hmm=object(), active=SimpleNamespace(dp=1, is_serving=True), config=SimpleNamespace(max_devices=None),
        usable_devices=lambda: {0: None, 1: None}, adapters=adapters, scale_events=ScaleEvents())


def _hold(lock: threading.Lock, release: threading.Event) -> threading.Thread:
    """Hold `lock` on another thread until `release` is set (returns once it is held)."""
    held = threading.Event()

    def run() -> None:
        with lock:
            held.set()
            release.wait()

    t = threading.Thread(target=run, daemon=True)
    t.start()
    held.wait()
    return t


def test_a_manual_scale_waits_for_an_adapter_step_to_end():
    cluster = _cluster()
    release = threading.Event()
    holder = _hold(cluster.adapters.lock, release)
    threading.Timer(0.2, release.set).start()
    event = Scaler(cluster).start(2, lock_wait_s=5.0)
    holder.join()
    assert (event.from_dp, event.to_dp) == (1, 2)
    assert cluster.scale_events.running is event


def test_without_a_wait_the_scale_is_refused_at_once_and_nothing_is_registered():
    cluster = _cluster()
    release = threading.Event()
    holder = _hold(cluster.adapters.lock, release)
    try:
        with pytest.raises(ScaleConflict, match="adapter is being loaded or unloaded"):
            Scaler(cluster).start(2)
        with pytest.raises(ScaleConflict):
            Scaler(cluster).start(2, lock_wait_s=0.05)  # held longer than the wait
    finally:
        release.set()
        holder.join()
    assert cluster.scale_events.running is None
    assert not cluster.adapters.lock.locked()  # the refused starts took nothing


def test_a_scale_asked_for_mid_switchover_is_a_conflict_not_an_outage():
    """Between a switchover's publish and its activation no instance is serving: a second scale
    asked for then is told a scale runs (409), not that nothing serves (503)."""
    cluster = _cluster()
    running = cluster.scale_events.start(1, 2, "concurrent")
    cluster.active.is_serving = False
    with pytest.raises(ScaleConflict, match=running.event_id):
        Scaler(cluster).start(3)
