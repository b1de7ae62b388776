"""The SLO-aware load estimator (ElasticMoE §4.3): attainment and load over a sliding window.

A finished request *attains* the SLO when its TTFT and its TPOT (mean gap between
output tokens after the first) are both within the targets; a request that
failed (rejected with 503, engine error) does not. Attainment is the fraction of
requests finished inside the window that attained it; the arrival rate counts
requests admitted inside the window.

`reset()` starts a new observation period: samples from before it no longer count
(after a scale, the old configuration's violations must not trigger the next
decision). Pure bookkeeping on an injectable clock; every method is O(1)
amortised and safe to call from the event loop only (no locking).
"""

from __future__ import annotations

import collections
import dataclasses
import math
import time
from collections.abc import Callable

from elasticmoe.entrypoints.openai.serving import RequestStats


@dataclasses.dataclass(frozen=True, slots=True)
class SloTargets:
    ttft_s: float
    tpot_s: float

    def __post_init__(self) -> None:
        if not (self.ttft_s > 0 and self.tpot_s > 0):
            raise ValueError(f"SLO targets must be > 0, got ttft {self.ttft_s}, tpot {self.tpot_s}")


@dataclasses.dataclass(frozen=True, slots=True)
class _Sample:
    t: float
    met: bool
    ttft_s: float | None  # None: failed before a first token
    tpot_s: float | None


@dataclasses.dataclass(frozen=True, slots=True)
class SloSnapshot:
    """The window as the autoscaler sees it. `attainment` is None with no finished request."""

    window_s: float  # the span actually observed (shorter right after a reset)
    num_finished: int
    num_met: int
    attainment: float | None
    arrival_rps: float
    finished_rps: float
    ttft_p90_s: float | None
    tpot_p90_s: float | None

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def tpot_of(stats: RequestStats) -> float | None:
    """Mean time per output token after the first (None without a first token)."""
    if stats.ttft_s is None:
        return None
    if stats.num_output_tokens <= 1:
        return 0.0
    return (stats.e2e_s - stats.ttft_s) / (stats.num_output_tokens - 1)


def _p90(values: list[float]) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, math.ceil(0.9 * len(ordered)) - 1)]


class SloTracker:
    """Observer of finished requests (`ServingObserver`) and of arrivals; read with `snapshot()`."""

    def __init__(self, targets: SloTargets, window_s: float = 30.0, clock: Callable[[], float] = time.monotonic):
        if window_s <= 0:
            raise ValueError(f"window_s: must be > 0, got {window_s}")
        self.targets = targets
        self.window_s = window_s
        self.clock = clock
        self._finished: collections.deque[_Sample] = collections.deque()
        self._arrivals: collections.deque[float] = collections.deque()
        self._since = clock()

    # ---- inputs --------------------------------------------------------------------------

    def on_arrival(self) -> None:
        self._arrivals.append(self.clock())

    def on_request_finished(self, stats: RequestStats) -> None:
        tpot = tpot_of(stats)
        met = (
            stats.finish_reason != "error"
            and stats.ttft_s is not None
            and stats.ttft_s <= self.targets.ttft_s
            and tpot is not None
            and tpot <= self.targets.tpot_s
        )
        self._finished.append(_Sample(self.clock(), met, stats.ttft_s, tpot))

    def on_request_failed(self) -> None:
        """A request that was admitted (or refused for capacity) and produced no answer."""
        self._finished.append(_Sample(self.clock(), False, None, None))

    def reset(self) -> None:
        """Forget everything observed so far (e.g. after the configuration changed)."""
        self._finished.clear()
        self._arrivals.clear()
        self._since = self.clock()

    # ---- output --------------------------------------------------------------------------

    def snapshot(self) -> SloSnapshot:
        now = self.clock()
        start = max(now - self.window_s, self._since)
        while self._finished and self._finished[0].t < start:
            self._finished.popleft()
        while self._arrivals and self._arrivals[0] < start:
            self._arrivals.popleft()
        span = max(now - start, 1e-9)
        samples = list(self._finished)
        met = sum(s.met for s in samples)
        return SloSnapshot(
            window_s=span,
            num_finished=len(samples),
            num_met=met,
            attainment=met / len(samples) if samples else None,
            arrival_rps=len(self._arrivals) / span,
            finished_rps=len(samples) / span,
            ttft_p90_s=_p90([s.ttft_s for s in samples if s.ttft_s is not None]),
            tpot_p90_s=_p90([s.tpot_s for s in samples if s.tpot_s is not None]),
        )
