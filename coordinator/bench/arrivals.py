"""Arrival patterns of the load generator: a rate `rps(t)` and seeded arrival times from it.

Every pattern is a `RateSchedule`. `arrivals(duration_s, rng)` draws the arrival times in
`[0, duration_s)` of a Poisson process modulated by `rps(t)` (thinning against
`max_rps`), so the expected count is the integral of `rps` over the run; `Constant` is
the one exception: evenly spaced, no randomness. Times are seconds since the load started
and the result depends only on the pattern, the duration and the RNG's state.

    Constant(rps)                    every 1/rps s, starting at t=0
    Poisson(rps)                     homogeneous Poisson
    Bursty(rps_on, rps_off, on_s, off_s)   on/off square wave, starting "on"
    Ramp(((t0, r0), (t1, r1), ...))  piecewise linear, held flat before the first and after the last point
    Patterned((r0, r1, ...))         rps per one-second slot, repeating (`parse_rate_csv` reads a CSV)
"""

from __future__ import annotations

import abc
import bisect
import dataclasses
import math
import random
from typing import Any


class RateSchedule(abc.ABC):
    """Offered load as a rate function; subclasses are frozen dataclasses (their fields are the config)."""

    __slots__ = ()

    name = "rate"

    @abc.abstractmethod
    def rps(self, t: float) -> float:
        """Requests/s at `t` seconds since the load started (>= 0)."""

    @abc.abstractmethod
    def max_rps(self, duration_s: float) -> float:
        """An upper bound of `rps(t)` over `[0, duration_s)`."""

    def arrivals(self, duration_s: float, rng: random.Random) -> list[float]:
        """Sorted arrival times in `[0, duration_s)`: Poisson with rate `rps(t)` (thinning)."""
        bound = self.max_rps(duration_s)
        out: list[float] = []
        if bound <= 0 or duration_s <= 0:
            return out
        t = 0.0
        while True:
            t += rng.expovariate(bound)
            if t >= duration_s:
                return out
            if rng.random() * bound < self.rps(t):
                out.append(t)

    def to_dict(self) -> dict[str, Any]:
        """The pattern and its parameters (for the JSON config)."""
        return {"pattern": self.name, **dataclasses.asdict(self)}  # type: ignore[call-overload]


def _check_rate(name: str, value: float) -> None:
    if not (value >= 0 and math.isfinite(value)):
        raise ValueError(f"{name}: need a finite rate >= 0, got {value}")


@dataclasses.dataclass(frozen=True, slots=True)
class Constant(RateSchedule):
    """Evenly spaced arrivals at t = 0, 1/rps, 2/rps, ... (deterministic)."""

    rate: float
    name = "constant"

    def __post_init__(self) -> None:
        _check_rate("rps", self.rate)

    def rps(self, t: float) -> float:
        return self.rate

    def max_rps(self, duration_s: float) -> float:
        return self.rate

    def arrivals(self, duration_s: float, rng: random.Random) -> list[float]:
        if self.rate <= 0:
            return []
        return [t for i in range(math.ceil(duration_s * self.rate)) if (t := i / self.rate) < duration_s]


@dataclasses.dataclass(frozen=True, slots=True)
class Poisson(RateSchedule):
    rate: float
    name = "poisson"

    def __post_init__(self) -> None:
        _check_rate("rps", self.rate)

    def rps(self, t: float) -> float:
        return self.rate

    def max_rps(self, duration_s: float) -> float:
        return self.rate


@dataclasses.dataclass(frozen=True, slots=True)
class Bursty(RateSchedule):
    """`rps_on` for `on_s` seconds, then `rps_off` for `off_s` seconds, repeating."""

    rps_on: float
    rps_off: float
    on_s: float
    off_s: float
    name = "bursty"

    def __post_init__(self) -> None:
        _check_rate("rps_on", self.rps_on)
        _check_rate("rps_off", self.rps_off)
        if not (self.on_s > 0 and self.off_s >= 0):
            raise ValueError(f"on_s/off_s: need on_s > 0 and off_s >= 0, got {self.on_s}, {self.off_s}")

    def is_on(self, t: float) -> bool:
        return t % (self.on_s + self.off_s) < self.on_s

    def rps(self, t: float) -> float:
        return self.rps_on if self.is_on(t) else self.rps_off

    def max_rps(self, duration_s: float) -> float:
        return max(self.rps_on, self.rps_off)


@dataclasses.dataclass(frozen=True, slots=True)
class Ramp(RateSchedule):
    """Piecewise-linear rate through `points` ((t, rps), strictly increasing t)."""

    points: tuple[tuple[float, float], ...]
    name = "ramp"

    def __post_init__(self) -> None:
        if not self.points:
            raise ValueError("ramp: need at least one (t, rps) point")
        for t, r in self.points:
            _check_rate(f"ramp point at t={t}", r)
        times = [t for t, _ in self.points]
        if times[0] < 0 or any(b <= a for a, b in zip(times, times[1:], strict=False)):
            raise ValueError(f"ramp: point times must be >= 0 and strictly increasing, got {times}")

    @classmethod
    def linear(cls, start_rps: float, end_rps: float, over_s: float) -> Ramp:
        """From `start_rps` at t=0 to `end_rps` at `over_s`, then flat."""
        if not over_s > 0:
            raise ValueError(f"ramp: need a duration > 0, got {over_s}")
        return cls(((0.0, start_rps), (over_s, end_rps)))

    def rps(self, t: float) -> float:
        pts = self.points
        i = bisect.bisect_right(pts, t, key=lambda p: p[0])
        if i == 0:
            return pts[0][1]
        if i == len(pts):
            return pts[-1][1]
        (t0, r0), (t1, r1) = pts[i - 1], pts[i]
        return r0 + (r1 - r0) * (t - t0) / (t1 - t0)

    def max_rps(self, duration_s: float) -> float:
        return max(r for _, r in self.points)  # a linear piece peaks at a vertex


@dataclasses.dataclass(frozen=True, slots=True)
class Patterned(RateSchedule):
    """`rps_per_s[i]` during second i; the pattern repeats past its end."""

    rps_per_s: tuple[float, ...]
    name = "csv"

    def __post_init__(self) -> None:
        if not self.rps_per_s:
            raise ValueError("rate pattern: no rows")
        for i, r in enumerate(self.rps_per_s):
            _check_rate(f"rate pattern second {i}", r)

    def rps(self, t: float) -> float:
        return self.rps_per_s[int(t) % len(self.rps_per_s)]

    def max_rps(self, duration_s: float) -> float:
        return max(self.rps_per_s[: max(1, math.ceil(duration_s))])


def parse_rate_csv(text: str) -> tuple[float, ...]:
    """Rates per second from CSV: one value a row, optionally under a header naming an `rps` column.

    With a header, the `rps` column is read (other columns are ignored); without one, the first
    column. Blank lines and `#` comments are skipped. A bad value raises `ValueError` naming its line.
    """
    rows = [(n, line.strip()) for n, line in enumerate(text.splitlines(), 1)]
    rows = [(n, line) for n, line in rows if line and not line.startswith("#")]
    if not rows:
        raise ValueError("no rows")
    column = 0
    first_n, first = rows[0]
    if not _is_number(first.split(",")[0]):
        header = [h.strip().lower() for h in first.split(",")]
        if "rps" not in header:
            raise ValueError(f"line {first_n}: want a number or a header with an 'rps' column, got {first!r}")
        column, rows = header.index("rps"), rows[1:]
    out: list[float] = []
    for n, line in rows:
        cells = line.split(",")
        cell = cells[column].strip() if column < len(cells) else ""
        if not _is_number(cell) or not (float(cell) >= 0 and math.isfinite(float(cell))):
            raise ValueError(f"line {n}: want a finite rate >= 0, got {cell!r}")
        out.append(float(cell))
    if not out:
        raise ValueError("no rows under the header")
    return tuple(out)


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True
