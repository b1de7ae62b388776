"""Per-device memory accounting: current and peak bytes against a budget.

Every byte of device memory the HMM hands out (a shm tensor, a page of a page
pool) is charged here *before* the memory is created, and released after it is
freed, so `used` is an upper bound of what the device holds and an over-budget
request fails without side effects. Peak bytes during a scale event is a headline
metric (`reset_peak()` before, `peak` after).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass


class OutOfDeviceMemory(MemoryError):
    """An allocation would exceed the device's memory budget. Nothing was allocated."""

    def __init__(self, device_id: str, requested: int, used: int, budget: int, what: str = "") -> None:
        self.device_id = device_id
        self.requested = requested
        self.used = used
        self.budget = budget
        detail = f" ({what})" if what else ""
        super().__init__(
            f"device {device_id}: out of memory{detail}: requested {requested} bytes, "
            f"{used} of {budget} bytes in use, {max(budget - used, 0)} free"
        )


@dataclass(frozen=True, slots=True)
class MemoryUsage:
    """A snapshot of one device's accounting."""

    device_id: str
    used: int
    peak: int
    budget: int

    @property
    def free(self) -> int:
        return self.budget - self.used


class MemoryAccount:
    """Current/peak bytes of one device. Thread-safe.

    Invariants: `0 <= used <= budget` and `used <= peak`; `peak` only decreases
    through `reset_peak()`.
    """

    def __init__(self, device_id: str | int, budget: int) -> None:
        if budget < 0:
            raise ValueError(f"budget must be >= 0, got {budget}")
        self.device_id = str(device_id)
        self.budget = budget
        self._used = 0
        self._peak = 0
        self._lock = threading.Lock()

    @property
    def used(self) -> int:
        return self._used

    @property
    def peak(self) -> int:
        return self._peak

    def can_allocate(self, num_bytes: int) -> bool:
        return self._used + num_bytes <= self.budget

    def reserve(self, num_bytes: int, what: str = "") -> None:
        """Charge `num_bytes`, or raise `OutOfDeviceMemory` leaving the account unchanged."""
        if num_bytes < 0:
            raise ValueError(f"cannot reserve a negative size ({num_bytes})")
        with self._lock:
            if self._used + num_bytes > self.budget:
                raise OutOfDeviceMemory(self.device_id, num_bytes, self._used, self.budget, what)
            self._used += num_bytes
            self._peak = max(self._peak, self._used)

    def release(self, num_bytes: int) -> None:
        """Give back bytes charged by `reserve`."""
        with self._lock:
            if num_bytes < 0 or num_bytes > self._used:
                raise ValueError(f"device {self.device_id}: release of {num_bytes} with {self._used} in use")
            self._used -= num_bytes

    def reset_peak(self) -> None:
        """Start a new peak window at the current usage."""
        with self._lock:
            self._peak = self._used

    def usage(self) -> MemoryUsage:
        with self._lock:
            return MemoryUsage(self.device_id, self._used, self._peak, self.budget)
