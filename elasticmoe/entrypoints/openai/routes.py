"""The OpenAI routes and the request guards, shared by the single-process server
(`api_server`) and the elastic server's ingress (`coordinator.ingress`).

Nothing here touches an engine or a tensor: the ingress imports this module, and it runs
without PyTorch (a process that only holds HTTP connections should not load it).

A client that disconnects cancels its request: streams via Starlette's disconnect listener
(the SSE stream is closed, which aborts the engine request), non-streaming requests via
`_cancel_on_disconnect`.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Coroutine
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel
from starlette.types import Receive, Scope, Send

from elasticmoe.entrypoints.openai.access import AccessMiddleware, AccessPolicy
from elasticmoe.entrypoints.openai.choices import ADAPTER_STATE_HEADER
from elasticmoe.entrypoints.openai.drain import Drainer, DrainMiddleware
from elasticmoe.entrypoints.openai.metrics import RequestCountMiddleware, ServerMetrics
from elasticmoe.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest
from elasticmoe.entrypoints.openai.serving import OpenAIServing, SSEStream

_CLIENT_CLOSED = 499  # nginx's "client closed request"; only ever seen in metrics


class _SSEResponse(StreamingResponse):
    """A streaming response that always closes its `SSEStream` (aborting the engine request)."""

    body_iterator: SSEStream

    def __init__(self, stream: SSEStream) -> None:
        super().__init__(
            stream,
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no", **_adapter_header(stream.adapter_state)},
        )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.body_iterator.aclose()


def _to_response(result: BaseModel | SSEStream) -> Response:
    if isinstance(result, SSEStream):
        return _SSEResponse(result)
    return JSONResponse(result.model_dump(mode="json"), headers=_adapter_header(getattr(result, "_adapter_state", None)))


def _adapter_header(state: str | None) -> dict[str, str]:
    return {ADAPTER_STATE_HEADER: state} if state is not None else {}


async def _wait_for_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _cancel_on_disconnect(
    request: Request, handler: Coroutine[Any, Any, BaseModel | SSEStream]
) -> Response:
    """Run `handler`; if the client goes away first, cancel it (which aborts its engine request)."""
    task = asyncio.ensure_future(handler)
    listener = asyncio.ensure_future(_wait_for_disconnect(request))
    try:
        await asyncio.wait({task, listener}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:  # the server cancelled us (e.g. Ray Serve on client disconnect)
        task.cancel()
        raise
    finally:
        listener.cancel()
    if not task.done():
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await task
        return Response(status_code=_CLIENT_CLOSED)
    return _to_response(task.result())


def add_openai_routes(app: FastAPI, serving: OpenAIServing) -> None:
    """`POST /v1/completions`, `POST /v1/chat/completions` and `GET /v1/models` on `serving`.

    Shared by this server and the coordinator; a client that disconnects cancels its request.
    """

    @app.post("/v1/completions")
    async def create_completion(body: CompletionRequest, request: Request) -> Response:
        return await _cancel_on_disconnect(request, serving.create_completion(body))

    @app.post("/v1/chat/completions")
    async def create_chat_completion(body: ChatCompletionRequest, request: Request) -> Response:
        return await _cancel_on_disconnect(request, serving.create_chat_completion(body))

    @app.get("/v1/models")
    async def show_models() -> Response:
        return _to_response(serving.show_models())


def install_guards(
    app: FastAPI, access: AccessPolicy, drainer: Drainer, metrics: ServerMetrics, endpoints: frozenset[str]
) -> None:
    """Middleware, outermost first: request counting (sees 401/413/503 too), keys and size
    limits, drain (counts in-flight `/v1/*`). Shared with the coordinator."""
    app.add_middleware(DrainMiddleware, drainer=drainer)
    app.add_middleware(AccessMiddleware, policy=access)
    app.add_middleware(RequestCountMiddleware, metrics=metrics, endpoints=endpoints)
