"""Request routing: the active instance's least-loaded DP rank, held during a switchover.

The router holds the current `ActiveInstance` snapshot (what the cluster published last)
and knows its ranks only as opaque targets with a load count, so it can be tested
without Ray. A switchover's critical section (old instance stopped at a
step boundary, sequences handed over, new instance not yet active) closes the
gate: new requests wait at the gate instead of failing, for at most
`max_hold_s`, and are then routed to whatever instance is active.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from coordinator.active import ActiveInstance

T = TypeVar("T")


class NoActiveInstance(RuntimeError):
    """No instance can take requests (none active, or the gate stayed closed too long)."""


@dataclass
class _Routes(Generic[T]):
    targets: list[T]
    in_flight: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.in_flight = [0] * len(self.targets)


class Router(Generic[T]):
    """Least-loaded choice among the active instance's ranks, by requests in flight.

    Invariant: `in_flight` counts requests between `route()` entering and its
    context exiting, per rank of the instance that was active when they entered;
    requests of a retired instance finish against its own counters.
    """

    def __init__(self, max_hold_s: float = 30.0) -> None:
        self.max_hold_s = max_hold_s
        self.active: ActiveInstance | None = None  # the last snapshot published (see coordinator.active)
        self._routes: _Routes[T] | None = None
        self._open = asyncio.Event()
        self._open.set()
        self._changed = asyncio.Event()  # set (and replaced) whenever the targets change
        self.num_held = 0  # requests currently waiting at the gate (for metrics)

    def set_active(self, active: ActiveInstance) -> None:
        """Route new requests to `active`'s ranks (a new instance), or take its other facts (the
        same ranks: only its adapters changed; in-flight counts are kept then)."""
        if self.active is None or self._routes is None or active.ranks != self.active.ranks:
            self._routes = _Routes(list(active.ranks))
            self._announce_change()
        self.active = active

    def clear_active(self) -> None:
        self._routes = None
        self.active = None
        self._announce_change()

    def _announce_change(self) -> None:
        changed, self._changed = self._changed, asyncio.Event()
        changed.set()

    def is_active_target(self, target: T) -> bool:
        routes = self._routes
        return routes is not None and any(t is target or t == target for t in routes.targets)

    async def wait_replaced(self, target: T, timeout_s: float) -> bool:
        """Wait until `target` is no longer one of the active targets (its instance was replaced
        or cleared); False if it still is after `timeout_s`."""
        deadline = asyncio.get_running_loop().time() + timeout_s
        while self.is_active_target(target):
            remaining = deadline - asyncio.get_running_loop().time()
            if remaining <= 0:
                return False
            try:
                await asyncio.wait_for(self._changed.wait(), remaining)
            except TimeoutError:
                return False
        return True

    def close_gate(self) -> None:
        """Start of a switchover's critical section: hold new requests."""
        self._open.clear()

    def open_gate(self) -> None:
        """End of the critical section: release held requests to the active instance."""
        self._open.set()

    @property
    def is_open(self) -> bool:
        return self._open.is_set()

    def loads(self) -> list[int]:
        return list(self._routes.in_flight) if self._routes else []

    @contextlib.asynccontextmanager
    async def route(self) -> AsyncIterator[T]:
        """Yield the least-loaded rank; its in-flight count covers the body of the `async with`."""
        if not self._open.is_set():
            self.num_held += 1
            try:
                await asyncio.wait_for(self._open.wait(), timeout=self.max_hold_s)
            except TimeoutError as exc:
                raise NoActiveInstance(f"switchover did not finish within {self.max_hold_s:.0f}s") from exc
            finally:
                self.num_held -= 1
        routes = self._routes
        if routes is None:
            raise NoActiveInstance("no active instance")
        rank = min(range(len(routes.targets)), key=routes.in_flight.__getitem__)
        routes.in_flight[rank] += 1
        try:
            yield routes.targets[rank]
        finally:
            routes.in_flight[rank] -= 1
