"""The two small fits of CoServe's offline phase: a least-squares line (K and B of the latency
model, §4.5 Fig. 12; the trend of the decay-window search, §4.4 Eq. 2) and the batch size where
the average latency per request plateaus (the maximum batch size, §4.5 Fig. 5)."""

from __future__ import annotations

from collections.abc import Sequence


def linear_fit(xs: Sequence[float], ys: Sequence[float]) -> tuple[float, float]:
    """Least-squares (slope, intercept) of `ys` over `xs`. One point, or all `xs` equal: a flat
    line through the mean of `ys` (no trend can be read from it)."""
    if len(xs) != len(ys) or not xs:
        raise ValueError(f"linear_fit: need as many xs as ys, at least one, got {len(xs)} and {len(ys)}")
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    if sxx == 0:
        return 0.0, my
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sxx
    return slope, my - slope * mx


def plateau_batch(points: Sequence[tuple[int, float]], tolerance: float = 0.05) -> int:
    """The maximum batch size from (batch size, batch latency) points: the smallest batch size from
    which no larger size measured lowers the average latency per request (latency / size) by
    `tolerance` (relative) or more — the processor is nearly fully used there. Looking at every
    larger size, not just the next, keeps one disturbed measurement from ending the curve early.
    """
    if not points:
        raise ValueError("plateau_batch: no points")
    if not 0 <= tolerance < 1:
        raise ValueError(f"plateau_batch: tolerance must be in [0, 1), got {tolerance}")
    ordered = sorted(points)
    if ordered[0][0] < 1:
        raise ValueError(f"plateau_batch: batch sizes must be >= 1, got {ordered[0][0]}")
    averages = [(b, t / b) for b, t in ordered]
    for i, (b, avg) in enumerate(averages):
        if all(later > avg * (1 - tolerance) for _, later in averages[i + 1:]):
            return b
    return ordered[-1][0]  # unreachable: the last size always qualifies
