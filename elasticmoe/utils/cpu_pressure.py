"""How contended this host's CPUs are, to pick how many threads a step should use.

A step's OpenMP regions end at barriers every thread must reach. When other processes keep a
core busy, the thread on it waits for a time slice at every region, and two threads in lockstep
run slower than one (measured beside another team's test suite: 21-110 output tok/s with two
threads, 280-1000 with one). `ThreadGovernor` reads Linux's CPU pressure (PSI,
/proc/pressure/cpu "some avg10": the share of the last 10 s in which some task waited for a CPU)
every few seconds and drops to one thread above `high` (60%), back to all of them below `low` (20%).
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

logger = logging.getLogger(__name__)

_PSI = Path("/proc/pressure/cpu")


def cpu_pressure() -> float | None:
    """Percent of the last 10 s some task waited for a CPU (PSI), or None where PSI is missing."""
    try:
        first = _PSI.read_text().splitlines()[0]  # "some avg10=12.34 avg60=... total=..."
        return float(first.split()[1].split("=")[1])
    except (OSError, IndexError, ValueError):
        return None


class ThreadGovernor:
    """The thread count for the next step: `num_threads`, or 1 while the CPUs are contended.

    Disabled (always `num_threads`) with ELASTICMOE_ADAPTIVE_THREADS=0, without PSI, or with a
    single thread."""

    def __init__(self, num_threads: int, high: float = 60.0, low: float = 20.0, period_s: float = 2.0,
                 read=cpu_pressure) -> None:
        self.num_threads, self.high, self.low, self.period_s = num_threads, high, low, period_s
        self.read = read
        self.enabled = (num_threads > 1 and os.environ.get("ELASTICMOE_ADAPTIVE_THREADS") != "0"
                        and read() is not None)
        self.current = num_threads
        self._next_check = 0.0

    def threads(self) -> int:
        if not self.enabled:
            return self.num_threads
        now = time.monotonic()
        if now >= self._next_check:
            self._next_check = now + self.period_s
            pressure = self.read()
            if pressure is not None:
                if self.current > 1 and pressure > self.high:
                    self.current = 1
                    logger.info("cpu pressure %.0f%%: steps run on 1 thread", pressure)
                elif self.current == 1 and pressure < self.low:
                    self.current = self.num_threads
                    logger.info("cpu pressure %.0f%%: steps run on %d threads", pressure, self.num_threads)
        return self.current
