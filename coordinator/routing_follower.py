"""The ingress's side of the routing feed: keep the router on the coordinator's latest state.

A background task long-polls the coordinator (`fetch(after, timeout_s)`: returns a state as
soon as it differs from `after`, or the same one after `timeout_s` as a heartbeat) and hands
each new state to the router. When the coordinator cannot be reached (killed, restarting
under Serve, hung), the router keeps the last ranks but holds new requests and says it is
not serving (`/ready` 503, `/health` names the coordinator) until a state arrives again. The
coordinator's ranks die with it (Ray ends the actors a process owned); the requests that ran
there wait until the restarted coordinator publishes a new instance and continue on it from
what their clients received (`RouterEngineClient`).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections.abc import Awaitable, Callable

from coordinator.router import Router
from coordinator.routing_state import RoutingState
from elasticmoe.errors import describe_error

logger = logging.getLogger(__name__)

Fetch = Callable[[tuple[str, int] | None, float], Awaitable[RoutingState]]
COORDINATOR = "coordinator"  # the key of the follower's own fault in `/health`


class RoutingFollower:
    def __init__(self, fetch: Fetch, router: Router, poll_timeout_s: float = 10.0, retry_s: float = 0.25) -> None:
        self.fetch = fetch
        self.router = router
        self.poll_timeout_s = poll_timeout_s
        self.retry_s = retry_s
        self.is_connected = False
        self.last_error: str | None = None
        self.disconnected_since: float | None = None  # monotonic seconds
        self._task: asyncio.Task[None] | None = None
        self._serving = asyncio.Event()  # set once a state with ranks accepting requests arrived

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name="routing-follower")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    async def wait_serving(self, timeout_s: float | None = None) -> None:
        """Return once the coordinator published an instance accepting requests."""
        await asyncio.wait_for(self._serving.wait(), timeout_s)

    async def _run(self) -> None:
        key: tuple[str, int] | None = None
        while True:
            try:
                state = await asyncio.wait_for(self.fetch(key, self.poll_timeout_s), self.poll_timeout_s + 5.0)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - unreachable, for whatever reason
                self._lost(describe_error(exc) or type(exc).__name__)
                key = None  # the next answer comes at once: the state as it is now
                await asyncio.sleep(self.retry_s)
                continue
            if not self.is_connected:
                logger.info("coordinator reachable (state %s v%d)", state.epoch, state.version)
            self.is_connected, self.last_error, self.disconnected_since = True, None, None
            if state.key != key or self.router.state is None or self.router.state.key != state.key:
                self.router.update(state)
                key = state.key
            if state.ranks and state.is_accepting:
                self._serving.set()

    def _lost(self, error: str) -> None:
        if self.is_connected or self.disconnected_since is None:
            logger.warning("coordinator unreachable (%s); holding new requests", error)
            self.disconnected_since = time.monotonic()
        self.is_connected, self.last_error = False, error
        state = self.router.state
        if state is None:
            return
        faults = dict(state.faults)
        faults[COORDINATOR] = f"unreachable: {error}"
        # The same ranks (in-flight counts kept, failed requests still wait for them to be replaced).
        held = dataclasses.replace(state, is_accepting=False, is_serving=False, faults=tuple(sorted(faults.items())))
        if held != state:
            self.router.update(held)
