"""End a Ray worker process when its raylet is gone, after freeing what it holds.

A Ray worker runs under its node's raylet. When the raylet dies (the node shuts down, or
a service manager SIGTERMs the whole process group at once), Ray does not end the
workers: their main thread sits in Ray's C++ task loop, where Python's SIGTERM handler
never runs, so they linger, orphaned, until a SIGKILL, holding their memory. A device
worker's memory is /dev/shm files, which would outlive it. `watch_parent` runs a thread
that notices the parent is gone (the process is re-parented), runs `cleanup` (a device
worker unlinks its files) and exits the process.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable

logger = logging.getLogger(__name__)


def in_ray_actor() -> bool:
    """True inside a Ray actor's process (not in a driver or a plain process)."""
    try:
        import ray

        return ray.is_initialized() and ray.get_runtime_context().get_actor_id() is not None
    except Exception:  # noqa: BLE001 - no Ray, no actor
        return False


def watch_parent(cleanup: Callable[[], None] = lambda: None, interval_s: float = 0.5) -> threading.Thread:
    """Start the watcher thread: when this process's parent is gone, `cleanup()` then `os._exit(0)`."""
    parent = os.getppid()

    def watch() -> None:
        stop = threading.Event()
        while not stop.wait(interval_s):
            if os.getppid() != parent:
                logger.warning("parent process %d is gone (raylet down): freeing and exiting", parent)
                try:
                    cleanup()
                except BaseException:  # noqa: BLE001 - exit anyway
                    logger.exception("cleanup before exiting failed")
                os._exit(0)

    thread = threading.Thread(target=watch, name="lifeline", daemon=True)
    thread.start()
    return thread
