"""Start the elastic server: Ray (local or joined), Serve on host:port, the coordinator app.

`start_elastic` returns once the coordinator replica has brought up the HMM and
activated the first instance (Serve only routes to a replica whose constructor
finished); `ElasticServer.shutdown` undoes everything it started, in order:
instance + HMM memory (explicitly, so no /dev/shm file outlives the server),
then Serve, then Ray if it started it. `serve_elastic` adds SIGTERM/SIGINT: drain
(new requests 503, those in flight finish up to `shutdown_timeout_s`), then shut down.
"""

from __future__ import annotations

import dataclasses
import logging
import signal
import threading
from collections.abc import Callable
from types import FrameType
from typing import Any

import ray
from ray import serve

from coordinator.app import Coordinator
from coordinator.config import CoordinatorConfig

logger = logging.getLogger(__name__)

APP_NAME = "elasticmoe"
_ADMIN_SLACK = 64  # Serve slots beyond --max-queued, so that overflow reaches our 503 and probes pass


@dataclasses.dataclass
class ElasticServer:
    """A running elastic server; `shutdown()` is idempotent."""

    url: str
    config: CoordinatorConfig
    handle: Any  # DeploymentHandle of the coordinator
    owns_ray: bool
    is_shut_down: bool = False

    def drain(self, timeout_s: float | None = None) -> dict:
        """New `/v1/*` requests get 503, those in flight finish (up to `timeout_s`, default the
        config's `shutdown_timeout_s`); the autoscaler stops. What happened, as a dict."""
        wait = self.config.shutdown_timeout_s if timeout_s is None else timeout_s
        return self.handle.drain.remote(timeout_s).result(timeout_s=wait + 30)

    def shutdown(self, timeout_s: float = 120.0) -> None:
        if self.is_shut_down:
            return
        self.is_shut_down = True
        try:
            self.handle.shutdown_cluster.remote().result(timeout_s=timeout_s)
        except Exception:  # noqa: BLE001 - Serve's shutdown runs the replica's destructor anyway
            logger.exception("coordinator shutdown failed")
        serve.shutdown()
        if self.owns_ray:
            ray.shutdown()
        logger.info("elastic server stopped")


def coordinator_app(config: CoordinatorConfig) -> Any:
    """The Serve application of one coordinator replica for `config`."""
    deployment = Coordinator.options(  # type: ignore[attr-defined]
        max_ongoing_requests=config.max_queued + _ADMIN_SLACK
    )
    return deployment.bind(config)


def start_elastic(
    config: CoordinatorConfig,
    host: str = "127.0.0.1",
    port: int = 8000,
    address: str | None = None,
    ray_init_kwargs: dict[str, Any] | None = None,
    after_ray_init: Callable[[], None] | None = None,
) -> ElasticServer:
    """Connect to (`address`) or start a local Ray, deploy the coordinator on host:port, wait until ready.

    `after_ray_init` runs right after `ray.init` (which installs its own SIGTERM handlers).
    """
    owns_ray = not ray.is_initialized()
    if owns_ray:
        ray.init(address=address, include_dashboard=False, **(ray_init_kwargs or {}))
    if after_ray_init is not None:
        after_ray_init()
    try:
        serve.start(http_options={"host": host, "port": port})
        handle = serve.run(coordinator_app(config), name=APP_NAME, route_prefix="/")
    except BaseException:
        serve.shutdown()
        if owns_ray:
            ray.shutdown()
        raise
    url = f"http://{'127.0.0.1' if host in ('0.0.0.0', '') else host}:{port}"
    logger.info("elastic server ready at %s: %s, %d devices, dp %d", url, config.model_name,
                config.num_devices, config.dp)
    return ElasticServer(url, config, handle, owns_ray)


def serve_elastic(
    config: CoordinatorConfig, host: str = "127.0.0.1", port: int = 8000, address: str | None = None
) -> int:
    """Serve `config` until SIGTERM/SIGINT, then shut everything down. Returns an exit code."""
    stop = threading.Event()

    def on_signal(signum: int, frame: FrameType | None) -> None:
        if stop.is_set() and signum == signal.SIGINT:
            raise KeyboardInterrupt  # a second Ctrl-C: stop waiting for the drain
        logger.info("received %s; draining for up to %.0f s, then shutting down", signal.Signals(signum).name,
                    config.shutdown_timeout_s)
        stop.set()

    def install_handlers() -> None:
        # NOTE: after `ray.init`, whose C++ failure handler would otherwise abort the process on
        # SIGTERM; a signal during the (long) deployment is then served by shutting down right after.
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, on_signal)

    previous = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        server = start_elastic(config, host, port, address, after_ray_init=install_handlers)
        try:
            while not stop.wait(0.5):
                pass
            try:
                logger.info("drain: %s", server.drain())
            except Exception:  # noqa: BLE001 - shut down anyway
                logger.exception("drain failed; shutting down")
        finally:
            server.shutdown()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return 0
