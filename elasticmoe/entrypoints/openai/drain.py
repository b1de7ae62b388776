"""Graceful drain: stop taking inference requests, let the ones in flight finish.

`DrainMiddleware` counts `/v1/*` requests until their response is complete (for a
stream, its last event). Once `Drainer.start()` ran, new `/v1/*` requests get 503
with `Retry-After` (a load balancer retries them elsewhere) and `/ready` should
report not ready; `/health`, `/metrics` and `/admin/*` keep working so an operator
can watch the drain. `wait_idle(timeout)` returns when nothing is in flight.

Used on SIGTERM by both servers, and by `POST /admin/drain` (Kubernetes preStop).
"""

from __future__ import annotations

import asyncio
import json
import time

from fastapi import FastAPI
from fastapi.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from elasticmoe.entrypoints.openai.errors import OpenAIError


class Drainer:
    """In-flight count and the draining flag; lives on the server's event loop."""

    def __init__(self) -> None:
        self.in_flight = 0
        self.is_draining = False
        self.refused = 0
        self._idle = asyncio.Event()
        self._idle.set()

    def start(self) -> None:
        self.is_draining = True

    def enter(self) -> None:
        self.in_flight += 1
        self._idle.clear()

    def leave(self) -> None:
        self.in_flight -= 1
        if self.in_flight == 0:
            self._idle.set()

    async def wait_idle(self, timeout_s: float) -> bool:
        """True if nothing is in flight within `timeout_s`."""
        try:
            await asyncio.wait_for(self._idle.wait(), timeout_s)
        except TimeoutError:
            return False
        return True

    async def drain(self, timeout_s: float) -> dict:
        """Start draining and wait; what happened, for logs and `POST /admin/drain`."""
        t0 = time.perf_counter()
        self.start()
        drained = await self.wait_idle(timeout_s)
        return {"drained": drained, "in_flight": self.in_flight, "waited_s": round(time.perf_counter() - t0, 3),
                "refused": self.refused}


class DrainMiddleware:
    def __init__(self, app: ASGIApp, drainer: Drainer) -> None:
        self.app = app
        self.drainer = drainer

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not scope.get("path", "").startswith("/v1/"):
            await self.app(scope, receive, send)
            return
        drainer = self.drainer
        if drainer.is_draining:
            drainer.refused += 1
            body = json.dumps({"error": {"message": "The server is shutting down; retry on another replica.",
                                         "type": "ServiceUnavailableError", "param": None, "code": 503}}).encode()
            await send({"type": "http.response.start", "status": 503,
                        "headers": [(b"content-type", b"application/json"), (b"retry-after", b"1"),
                                    (b"content-length", str(len(body)).encode())]})
            await send({"type": "http.response.body", "body": body})
            return
        drainer.enter()
        try:
            await self.app(scope, receive, send)
        finally:
            drainer.leave()


def add_drain_route(app: FastAPI, drainer: Drainer, default_timeout_s: float) -> None:
    """`POST /admin/drain?timeout_s=N`: start draining and answer when idle (or at the timeout).

    Draining is one-way: the server is about to stop (Kubernetes preStop, `elasticmoe drain`).
    """

    @app.post("/admin/drain")
    async def drain(timeout_s: float | None = None) -> JSONResponse:
        if timeout_s is not None and not 0 <= timeout_s <= 3600:
            raise OpenAIError("timeout_s: must be between 0 and 3600 seconds.", param="timeout_s")
        return JSONResponse(await drainer.drain(default_timeout_s if timeout_s is None else timeout_s))
