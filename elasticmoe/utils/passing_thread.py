"""Torch work off the engine's thread, in a thread that leaves when it is done.

GNU OpenMP (PyTorch's, and our kernels') keeps a team of worker threads per thread that opens a
parallel region, for as long as that thread lives. Once a process manages more OpenMP threads than
it has CPUs, libgomp shortens the spin of every idle worker to ~100 iterations: the engine's worker
then sleeps at the end of every parallel region and waits for a futex wake at the start of the
next, dozens of times per step. `asyncio.to_thread` runs in pool threads that live on, so one
engine build there left a second team in every rank: its OpenMP worker switched ~1,000 times a
second against ~5 in the single-process server (whose engine is built on its loop thread).
A thread that exits takes its team with it (libgomp frees a thread's pool at its exit).
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")


async def in_passing_thread(fn: Callable[..., T], *args: Any, name: str = "torch-work") -> T:
    """`fn(*args)` in a new thread that exits afterwards (see the module docstring); its result or
    exception. Cancelling the caller does not stop `fn` (as with `asyncio.to_thread`)."""
    loop = asyncio.get_running_loop()
    future: asyncio.Future[T] = loop.create_future()

    def settle(result: Any, error: BaseException | None) -> None:
        if future.done():  # the caller was cancelled
            return
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)

    def run() -> None:
        try:
            result = fn(*args)
        except BaseException as exc:  # noqa: BLE001 - handed to the caller
            loop.call_soon_threadsafe(settle, None, exc)
        else:
            loop.call_soon_threadsafe(settle, result, None)

    threading.Thread(target=run, name=name, daemon=True).start()
    return await future
