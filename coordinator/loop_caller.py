"""Calls onto the router's event loop from other threads (asyncio objects are not thread-safe).

The router's gate and its snapshot of the active instance belong to the coordinator's event
loop; scales and repairs run on threads of their own and reach them through a `LoopCaller`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

# Runs a call on the thread that owns the router's asyncio loop and waits for it.
LoopCaller = Callable[[Callable[[], None]], None]


def call_here(fn: Callable[[], None]) -> None:
    """The `LoopCaller` of a router without a running loop (tests, start-up before serving)."""
    fn()


def loop_caller(loop: asyncio.AbstractEventLoop, timeout_s: float = 30.0) -> LoopCaller:
    """A `LoopCaller` for a router owned by `loop`."""

    def call(fn: Callable[[], None]) -> None:
        async def run() -> None:
            fn()

        asyncio.run_coroutine_threadsafe(run(), loop).result(timeout=timeout_s)

    return call
