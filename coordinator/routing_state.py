"""What an ingress routes by, published by the coordinator: one immutable `RoutingState` per change.

The coordinator (the one process that owns the HMM and the instances) is the only author;
every ingress replica follows it (`coordinator.routing_follower`) and routes requests to the
ranks it names. A state is published when an instance becomes active (start, scale, repair),
when a switchover's critical section starts or ends (`is_accepting`), when the adapters that
accept requests change, and when health changes (`is_serving`, `faults`).

`RoutingFeed` keeps the latest state. Publishing is thread-safe (scales and repairs run on
threads of their own) and wakes the long-polls (`next`) of the coordinator's event loop.
Versions increase within one coordinator process (`epoch`); a restarted coordinator starts
a new epoch, so a follower never mistakes its first state for an old one.
"""

from __future__ import annotations

import asyncio
import dataclasses
import threading
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class RoutingState:
    """The ranks to route to (DP rank order; empty: none yet), their context limit, the adapters
    accepting requests (and which of them must be swapped in first), whether new requests may start now (False inside a switchover's critical
    section: hold them), and what `/ready` and `/health` say."""

    epoch: str  # the publishing coordinator's incarnation
    version: int  # increases with every state of that incarnation
    instance_id: str | None = None
    ranks: tuple[Any, ...] = ()  # `InstanceRank` actor handles
    max_model_len: int = 0
    adapters: tuple[str, ...] = ()
    adapter_kinds: tuple[tuple[str, str], ...] = ()  # adapter -> "esft" | "lora" (the router's latency model)
    swapped_out: tuple[str, ...] = ()  # accepted adapters not resident: a request waits for its swap first
    is_accepting: bool = False
    is_serving: bool = False  # an instance serves and is not known to be broken (`/ready`)
    faults: tuple[tuple[str, str], ...] = ()  # component -> what is wrong (`/health`)
    has_given_up: bool = False  # repairs keep failing: only a restart helps (`/health` 503)

    @property
    def key(self) -> tuple[str, int]:
        return (self.epoch, self.version)

    def fault_dict(self) -> dict[str, str]:
        return dict(self.faults)


@dataclass(frozen=True, slots=True)
class Health:
    """The healer's view, carried in every state."""

    is_broken: bool = False  # the active instance cannot serve until it is replaced
    faults: tuple[tuple[str, str], ...] = ()
    has_given_up: bool = False

    @classmethod
    def of(cls, is_broken: bool, faults: Mapping[str, str], has_given_up: bool) -> Health:
        return cls(is_broken, tuple(sorted(faults.items())), has_given_up)


class RoutingFeed:
    """The latest `RoutingState` and its publication: `update` from any thread, `next` (a long
    poll) from coordinator's event loop, `current` from anywhere."""

    def __init__(self, epoch: str | None = None) -> None:
        self._lock = threading.Lock()
        self._state = RoutingState(epoch or uuid.uuid4().hex[:12], 0)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._changed: asyncio.Event | None = None

    @property
    def current(self) -> RoutingState:
        return self._state

    def update(self, **changes: Any) -> RoutingState:
        """Publish the current state with `changes` (fields of `RoutingState`) as a new version."""
        with self._lock:
            state = dataclasses.replace(self._state, version=self._state.version + 1, **changes)
            self._state = state
            loop = self._loop
        if loop is not None and not loop.is_closed():
            try:
                loop.call_soon_threadsafe(self._wake)
            except RuntimeError:  # the loop closed meanwhile (shutdown)
                pass
        return state

    def _wake(self) -> None:
        changed, self._changed = self._changed, asyncio.Event()
        if changed is not None:
            changed.set()

    async def next(self, after: tuple[str, int] | None, timeout_s: float) -> RoutingState:
        """The current state as soon as it differs from the one keyed `after` (None: at once), or
        the current one after `timeout_s` (a heartbeat: the follower knows the coordinator lives)."""
        if self._loop is None:
            self._loop = asyncio.get_running_loop()
        if self._changed is None:
            self._changed = asyncio.Event()
        deadline = self._loop.time() + timeout_s
        while self._state.key == after:
            remaining = deadline - self._loop.time()
            if remaining <= 0:
                break
            changed = self._changed
            try:
                await asyncio.wait_for(changed.wait(), remaining)
            except TimeoutError:
                break
        return self._state
