from __future__ import annotations

import pytest

from coordinator.scale_events import ScaleConflict, ScaleEvents, ScaleState


def test_one_scale_at_a_time_and_readback():
    events = ScaleEvents()
    first = events.start(1, 2, "elastic")
    with pytest.raises(ScaleConflict) as info:
        events.start(2, 3, "elastic")
    assert info.value.running_id == first.event_id
    first.peak_memory_bytes = 123
    events.finish(first)
    assert first.state is ScaleState.SUCCEEDED and first.scale_latency_s is not None
    second = events.start(2, 3, "cold_restart")
    events.finish(second, error="injected failure")
    assert second.state is ScaleState.ROLLED_BACK and second.error == "injected failure"
    assert events.get(first.event_id).to_dict()["state"] == "succeeded"
    assert events.get("scale-99") is None
    assert [e.event_id for e in events.all()] == [first.event_id, second.event_id]


def test_finishing_an_event_that_is_not_running_is_a_bug():
    events = ScaleEvents()
    e = events.start(1, 2, "elastic")
    events.finish(e)
    with pytest.raises(ValueError):
        events.finish(e)


def test_failure_after_the_switchover_is_failed_not_rolled_back_and_observers_see_each_event():
    seen: list[tuple[str, str]] = []
    events = ScaleEvents(on_finished=lambda e: seen.append((e.event_id, e.state.value)))
    e = events.start(1, 2, "elastic")
    events.finish(e, error="import failed", rolled_back=False)
    assert e.state is ScaleState.FAILED and e.to_dict()["state"] == "failed"
    assert seen == [(e.event_id, "failed")] and events.running is None
