"""The ingress replica's own HTTP server: uvicorn on the replica's event loop, bound to the
server's host:port, so that a streamed token goes rank -> ingress -> client.

Behind Serve's HTTP proxy every chunk of a stream also crossed the proxy actor, as one item
of a Ray streaming call per chunk: under 64 streaming clients the proxy and the replica's side
of that call took about as much CPU as the engine (docs/engine.md). `elasticmoe serve` runs
Serve without proxies and the ingress listens itself; a Serve application deployed by
someone else's config (KubeRay's `serveConfigV2`, `coordinator.deployment`) keeps Serve's
proxy, which reaches the same FastAPI app through `@serve.ingress`.

The socket is bound before the replica's constructor returns, so a port in use fails the
deployment with the address in the message (`elasticmoe serve` checks it before starting
anything, `elasticmoe.entrypoints.listen_address`). One replica: Serve restarts it on the head node
(`coordinator.launch`), where it binds the same address again.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
from collections.abc import Iterator

import uvicorn
from fastapi import FastAPI

from elasticmoe.entrypoints.listen_address import bind_address
from elasticmoe.entrypoints.openai.access import AccessPolicy

logger = logging.getLogger(__name__)

STARTUP_TIMEOUT_S = 10.0


@dataclasses.dataclass(frozen=True)
class HttpBinding:
    """Where the ingress listens (`elasticmoe serve --host/--port`)."""

    host: str
    port: int


class _ReplicaServer(uvicorn.Server):
    """uvicorn without signal handlers: the replica's process belongs to Ray, and the server's
    drain and shutdown come from the driver (`ElasticServer`), not from signals."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


class DirectHttp:
    """`app` served on `binding` from the running event loop until `stop()`."""

    def __init__(self, server: uvicorn.Server, task: asyncio.Task[None]) -> None:
        self.server = server
        self.task = task

    @classmethod
    async def start(cls, app: FastAPI, binding: HttpBinding, access: AccessPolicy) -> DirectHttp:
        sock = bind_address(binding.host, binding.port)
        config = uvicorn.Config(
            app, log_level="warning", access_log=False, timeout_graceful_shutdown=2, lifespan="off",
            h11_max_incomplete_event_size=access.max_header_bytes)
        server = _ReplicaServer(config)
        task = asyncio.create_task(server.serve(sockets=[sock]), name="ingress-http")
        loop = asyncio.get_running_loop()
        deadline = loop.time() + STARTUP_TIMEOUT_S
        while not server.started:
            if task.done():  # uvicorn exits on a startup error (logged by it)
                sock.close()
                task.result()
                raise RuntimeError(f"the ingress's HTTP server on {binding.host}:{binding.port} did not start")
            if loop.time() > deadline:
                server.should_exit = True
                raise TimeoutError(f"the ingress's HTTP server on {binding.host}:{binding.port} did not start "
                                   f"within {STARTUP_TIMEOUT_S:.0f} s")
            await asyncio.sleep(0.01)
        logger.info("ingress listening on %s:%d", binding.host, binding.port)
        return cls(server, task)

    def close(self) -> None:
        """Ask the server to stop (it looks every 0.1 s): it stops listening, and connections still
        open get `timeout_graceful_shutdown`, then end."""
        self.server.should_exit = True

    async def stop(self, timeout_s: float = 5.0) -> None:
        """`close()`, and wait until the server has stopped."""
        self.close()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(asyncio.shield(self.task), timeout_s)
        if not self.task.done():
            self.server.force_exit = True
            self.task.cancel()
