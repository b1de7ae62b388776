"""Starting a new local Ray cluster, once more when Ray misses its own startup deadlines.

On a node whose cores are saturated (a 2-core machine running a test suite, or a server started
beside other work) Ray's GCS can answer its own raylet too late: "Failed to get node info ...
Deadline Exceeded", "The current node timed out during startup". The next start succeeds at
once, so one slow start should end neither a server nor a test module. Every process of this
project that starts a local Ray does it here (the lowest layer that imports Ray).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import ray

logger = logging.getLogger(__name__)

LOCAL_RAY_ATTEMPTS = 2  # starts of a local Ray before the caller gets the error


def init_local_ray(*, attempts: int = LOCAL_RAY_ATTEMPTS, init: Callable[..., Any] = ray.init,
                   shutdown: Callable[[], None] = ray.shutdown, **kwargs: Any) -> None:
    """`init(address="local", include_dashboard=False, **kwargs)`, made again (after `shutdown`,
    which ends what the failed start left) when a start fails for other reasons than its
    arguments. `init`/`shutdown` are `ray.init`/`ray.shutdown` but for tests."""
    for attempt in range(1, attempts + 1):
        try:
            # NOTE: "local", not None: None joins a cluster `ray start` left on this machine (or RAY_ADDRESS's)
            init(address="local", include_dashboard=False, **kwargs)
            return
        except (TypeError, ValueError):
            raise  # the arguments: a second start would fail alike
        except Exception as exc:  # noqa: BLE001 - Ray raises a bare Exception for a missed deadline
            if attempt == attempts:
                raise
            logger.warning("starting the local Ray failed (%s: %s); starting it again (attempt %d of %d)",
                           type(exc).__name__, exc, attempt + 1, attempts)
            shutdown()
