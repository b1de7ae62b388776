"""What the ingress saw of requests, sent to the coordinator's SLO estimator in batches.

The ingress serves the requests; the autoscaler that reads their SLO attainment lives with
the coordinator (it starts scales). `ObservationBuffer` is the ingress's `ServingObserver`
and arrival/failure hook: it collects, and every `flush` hands one `Observations` batch to the
coordinator (`Coordinator.observe`), which replays it into its `SloTracker`. A batch that
cannot be delivered (the coordinator is restarting) is dropped: the new coordinator's
estimator starts empty anyway.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from coordinator.slo import SloTracker
from elasticmoe.entrypoints.openai.serving import RequestStats

MAX_BUFFERED = 10_000  # finished requests kept between two flushes (beyond: the oldest are dropped)


@dataclass(frozen=True, slots=True)
class Observations:
    num_arrivals: int
    num_failed: int
    finished: tuple[RequestStats, ...]
    adapters_used: tuple[tuple[str, int], ...] = ()  # adapter -> requests for it (the swaps' LRU and rates)

    def apply(self, tracker: SloTracker) -> None:
        """Replay into `tracker` (on its event loop)."""
        for _ in range(self.num_arrivals):
            tracker.on_arrival()
        for stats in self.finished:
            tracker.on_request_finished(stats)
        for _ in range(self.num_failed):
            tracker.on_request_failed()


@dataclass
class ObservationBuffer:
    """Arrivals, failures and finished requests since the last `take` (the ingress's event loop)."""

    num_arrivals: int = 0
    num_failed: int = 0
    finished: list[RequestStats] = field(default_factory=list)
    adapters_used: dict[str, int] = field(default_factory=dict)  # in order of last use

    def on_arrival(self) -> None:
        self.num_arrivals += 1

    def on_adapter(self, name: str) -> None:
        count = self.adapters_used.pop(name, 0)  # re-inserted last: the dict keeps the order of use
        self.adapters_used[name] = count + 1

    def on_failed(self) -> None:
        self.num_failed += 1

    def on_request_finished(self, stats: RequestStats) -> None:
        self.finished.append(stats)
        if len(self.finished) > MAX_BUFFERED:
            del self.finished[0]

    def take(self) -> Observations | None:
        """Everything collected since the last call (None: nothing)."""
        if not (self.num_arrivals or self.num_failed or self.finished or self.adapters_used):
            return None
        batch = Observations(self.num_arrivals, self.num_failed, tuple(self.finished),
                             tuple(self.adapters_used.items()))
        self.num_arrivals, self.num_failed, self.finished, self.adapters_used = 0, 0, [], {}
        return batch
