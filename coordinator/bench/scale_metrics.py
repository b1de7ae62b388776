"""Pure figures of a scale event from the load client's records (no I/O, no clocks).

All times are seconds on the records' axis (`loadgen.LoadResult`: since the load
started). Windows are half-open `[start_s, end_s)`. A streamed chunk counts as
`num_tokens / len(token_times_s)` tokens, so throughput is exact even when a chunk
carries more than one token.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence

from coordinator.bench.loadgen import RequestRecord

# The client-observed event window extends this far past the server's `finished_at`,
# so a stall that ends exactly at the switchover is still seen.
EVENT_TAIL_S = 1.0


@dataclasses.dataclass(frozen=True, slots=True)
class Window:
    start_s: float
    end_s: float

    def __post_init__(self) -> None:
        if self.end_s < self.start_s:
            raise ValueError(f"window ends before it starts: [{self.start_s}, {self.end_s})")

    @property
    def length_s(self) -> float:
        return self.end_s - self.start_s

    def contains(self, t: float) -> bool:
        return self.start_s <= t < self.end_s


@dataclasses.dataclass(frozen=True, slots=True)
class EventWindows:
    """Paper Table 2's windows around one scale: before / during / after, and the downtime window."""

    before: Window  # the W seconds before the POST
    during: Window  # POST -> POST + max(during_s, event length): the same span for every strategy
    after: Window  # the W seconds after `during`
    event: Window  # POST -> finished + EVENT_TAIL_S (client downtime is measured here)


def event_windows(
    post_s: float, finished_s: float, window_s: float, during_s: float = 0.0, earliest_s: float = 0.0
) -> EventWindows:
    """Windows of an event POSTed at `post_s` that finished at `finished_s`; `before` starts no
    earlier than `earliest_s`. Paper Table 2 compares strategies over one fixed `during` span
    (around the longest transition), so `during` lasts `during_s`, or the event if it is longer."""
    during_end = max(finished_s, post_s + during_s)
    return EventWindows(
        before=Window(max(earliest_s, post_s - window_s), post_s),
        during=Window(post_s, during_end),
        after=Window(during_end, during_end + window_s),
        event=Window(post_s, finished_s + EVENT_TAIL_S),
    )


def baseline_window(post_s: float, length_s: float, earliest_s: float = 0.0) -> Window:
    """A no-scale window as long as the event window (if the warm-up allows), ending at the POST."""
    return Window(max(earliest_s, post_s - length_s), post_s)


def token_arrivals(records: Iterable[RequestRecord]) -> list[tuple[float, float]]:
    """(time, tokens) of every streamed chunk of every request, in time order."""
    out: list[tuple[float, float]] = []
    for r in records:
        if not r.token_times_s:
            continue
        per_chunk = max(r.num_tokens, len(r.token_times_s)) / len(r.token_times_s)
        out.extend((t, per_chunk) for t in r.token_times_s)
    out.sort()
    return out


def output_throughput(records: Iterable[RequestRecord], window: Window) -> float:
    """Output tokens/s that arrived at the client within `window` (0 for an empty window)."""
    if window.length_s <= 0:
        return 0.0
    return sum(n for t, n in token_arrivals(records) if window.contains(t)) / window.length_s


def max_token_gap(records: Iterable[RequestRecord], window: Window) -> float:
    """Longest interval in `window` with no token arriving on any stream (window edges count as bounds).

    A first token is a token, so a new request starting to stream ends a gap too.
    """
    times = [t for t, _ in token_arrivals(records) if window.contains(t)]
    bounds = [window.start_s, *times, window.end_s]
    return max(b - a for a, b in zip(bounds, bounds[1:], strict=False))


def failed_requests(records: Iterable[RequestRecord], window: Window | None = None) -> int:
    """Requests (arriving in `window`, or all) that got a non-200, an error chunk or a broken stream."""
    return sum(1 for r in records if not r.is_ok and (window is None or window.contains(r.arrival_s)))


def attains_slo(record: RequestRecord, slo_ttft_s: float, slo_tpot_s: float) -> bool:
    """Succeeded with TTFT <= `slo_ttft_s` and mean TPOT <= `slo_tpot_s` (one-token requests: TTFT only)."""
    ttft, tpot = record.ttft_s, record.tpot_s
    if not record.is_ok or ttft is None or ttft > slo_ttft_s:
        return False
    return tpot is None or tpot <= slo_tpot_s


@dataclasses.dataclass(frozen=True, slots=True)
class SloBin:
    start_s: float
    num_requests: int
    num_attained: int

    @property
    def attainment(self) -> float | None:
        return self.num_attained / self.num_requests if self.num_requests else None


def slo_attainment_bins(
    records: Iterable[RequestRecord],
    window: Window,
    slo_ttft_s: float,
    slo_tpot_s: float,
    bin_s: float = 1.0,
) -> list[SloBin]:
    """SLO attainment per `bin_s` bin of request arrival over `window` (the last bin may be partial)."""
    if bin_s <= 0:
        raise ValueError(f"bin_s: must be > 0, got {bin_s}")
    num_bins = max(1, int(-(-window.length_s // bin_s)))
    counts, attained = [0] * num_bins, [0] * num_bins
    for r in records:
        if not window.contains(r.arrival_s):
            continue
        i = min(int((r.arrival_s - window.start_s) // bin_s), num_bins - 1)
        counts[i] += 1
        attained[i] += attains_slo(r, slo_ttft_s, slo_tpot_s)
    return [SloBin(window.start_s + i * bin_s, counts[i], attained[i]) for i in range(num_bins)]


@dataclasses.dataclass(frozen=True, slots=True)
class EventKey:
    strategy: str
    from_dp: int
    to_dp: int


def latency_ratios(
    latencies: Sequence[tuple[EventKey, float | None]], baseline: str = "cold_restart"
) -> list[float | None]:
    """Each event's scale latency over `baseline`'s for the same transition (None if either is missing).

    With several baseline events for one transition, the first is the reference.
    """
    reference: dict[tuple[int, int], float] = {}
    for key, latency in latencies:
        transition = (key.from_dp, key.to_dp)
        if key.strategy == baseline and latency is not None and transition not in reference:
            reference[transition] = latency
    out: list[float | None] = []
    for key, latency in latencies:
        ref = reference.get((key.from_dp, key.to_dp))
        out.append(None if latency is None or not ref else latency / ref)
    return out
