"""Scale events: one at a time, each with an id and the figures users watch.

`ScaleEvents` is the admin API's memory: `POST /admin/scale` starts an event
(409 while another runs), `GET /admin/scale/{id}` reads it back. The scaler
fills in the figures as the event progresses.
"""

from __future__ import annotations

import enum
import itertools
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field


class ScaleState(enum.StrEnum):
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    ROLLED_BACK = "rolled_back"  # failed before the switchover; the old instance kept serving
    FAILED = "failed"  # failed after the old instance stopped (not rolled back)


class ScaleConflict(RuntimeError):
    """A scale was requested while another one runs, or while adapters change (HTTP 409)."""

    def __init__(self, running_id: str | None, reason: str | None = None) -> None:
        super().__init__(reason or f"scale event {running_id} is still running")
        self.running_id = running_id


@dataclass
class ScaleEvent:
    event_id: str
    from_dp: int
    to_dp: int
    strategy: str
    state: ScaleState = ScaleState.RUNNING
    started_at: float = field(default_factory=time.time)
    finished_at: float | None = None
    scale_latency_s: float | None = None  # request accepted -> new instance active
    downtime_s: float | None = None  # longest interval with no instance accepting and progressing requests
    peak_memory_bytes: int | None = None  # summed over devices during the event
    requests_in_flight: int | None = None  # at switchover
    requests_handed_over: int | None = None
    # The HMM transition's bytes by source: bytes_disk, bytes_local_copy, bytes_p2p_fast (same
    # node, shared memory), bytes_p2p_gloo (torch.distributed between nodes or processes)
    bytes_moved: dict[str, int] | None = None
    # With expert offloading: cache rows the new instance filled before serving, with the experts
    # the old one used most (`Scaler._warm_expert_caches`).
    expert_rows_warmed: int | None = None
    # The target placement's busiest rank's expected load over the mean (1.0 = balanced), by the
    # tokens the old instance routed to each expert; None when it had routed none.
    expert_load_imbalance: float | None = None
    error: str | None = None
    fault: str | None = None  # a heal (strategy "heal"): what failed and was replaced
    detected_at: float | None = None  # a heal: when the fault was seen (epoch seconds)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["state"] = self.state.value
        return d


class ScaleEvents:
    """Registry of scale events; at most one RUNNING at any time."""

    def __init__(self, on_finished: Callable[[ScaleEvent], None] | None = None) -> None:
        self.on_finished = on_finished  # e.g. the metrics (called after the event is closed)
        self._events: dict[str, ScaleEvent] = {}
        self._ids = itertools.count(1)
        self._running: ScaleEvent | None = None
        self._lock = threading.Lock()  # a manual scale, the autoscaler and a repair may start at once

    @property
    def running(self) -> ScaleEvent | None:
        return self._running

    def start(self, from_dp: int, to_dp: int, strategy: str) -> ScaleEvent:
        with self._lock:
            if self._running is not None:
                raise ScaleConflict(self._running.event_id)
            event = ScaleEvent(f"scale-{next(self._ids)}", from_dp, to_dp, strategy)
            self._events[event.event_id] = event
            self._running = event
            return event

    def finish(self, event: ScaleEvent, error: str | None = None, rolled_back: bool = True) -> None:
        """Close a running event: succeeded, or with `error` rolled back (else failed)."""
        if event is not self._running:
            raise ValueError(f"scale event {event.event_id} is not the running one")
        event.finished_at = time.time()
        if error is None:
            event.state = ScaleState.SUCCEEDED
        else:
            event.state = ScaleState.ROLLED_BACK if rolled_back else ScaleState.FAILED
        event.error = error
        if event.scale_latency_s is None:
            event.scale_latency_s = event.finished_at - event.started_at
        self._running = None
        if self.on_finished is not None:
            self.on_finished(event)

    def get(self, event_id: str) -> ScaleEvent | None:
        return self._events.get(event_id)

    def all(self) -> list[ScaleEvent]:
        return list(self._events.values())
