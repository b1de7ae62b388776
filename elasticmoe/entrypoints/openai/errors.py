"""OpenAI error bodies and the FastAPI exception handlers that produce them.

Every error leaves the server as `{"error": {"message", "type", "param", "code"}}`
with a matching HTTP status:

- 400 `BadRequestError`: request validation (with `param` = offending top-level
  field), malformed JSON, `ValueError`s that carry `.param` (`SamplingParamError`,
  engine input errors);
- 404 `NotFoundError`: unknown model (`param="model"`);
- 500 `InternalServerError`: anything unexpected; the message never contains
  exception text, the traceback goes to the log.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from http import HTTPStatus
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from elasticmoe.adapters.esft_slots import AdapterConflictError, AdapterLimitError
from elasticmoe.entrypoints.openai.protocol import ErrorInfo, ErrorResponse
from elasticmoe.errors import UnknownAdapterError

logger = logging.getLogger(__name__)

_TYPES = {
    400: "BadRequestError",
    404: "NotFoundError",
    500: "InternalServerError",
    503: "ServiceUnavailableError",
}


class OpenAIError(Exception):
    """An error to report to the client as-is (message, status, type, param)."""

    def __init__(
        self,
        message: str,
        *,
        status_code: int = HTTPStatus.BAD_REQUEST,
        type: str | None = None,
        param: str | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.status_code = int(status_code)
        self.type = type or _TYPES.get(
            self.status_code, HTTPStatus(self.status_code).phrase.replace(" ", "") + "Error"
        )
        self.param = param

    def to_response(self) -> ErrorResponse:
        return ErrorResponse(
            error=ErrorInfo(message=self.message, type=self.type, param=self.param, code=self.status_code)
        )


def model_not_found(model: str) -> OpenAIError:
    return OpenAIError(
        f"The model `{model}` does not exist.", status_code=HTTPStatus.NOT_FOUND, param="model"
    )


def internal_error() -> OpenAIError:
    return OpenAIError("Internal server error.", status_code=HTTPStatus.INTERNAL_SERVER_ERROR)


def to_openai_error(exc: BaseException) -> OpenAIError:
    """Classify any exception: known client errors keep their message, the rest become a bare 500."""
    if isinstance(exc, OpenAIError):
        return exc
    if isinstance(exc, RequestValidationError):
        return _from_validation_errors(exc.errors())
    if isinstance(exc, UnknownAdapterError):  # unloaded between the model check and the engine
        return model_not_found(exc.adapter)
    if isinstance(exc, AdapterConflictError | AdapterLimitError):
        return OpenAIError(str(exc), status_code=HTTPStatus.CONFLICT, param="name")
    param = getattr(exc, "param", None)
    if isinstance(exc, ValueError) and isinstance(param, str):
        return OpenAIError(str(exc), param=param)
    return internal_error()


def error_json(err: OpenAIError) -> JSONResponse:
    return JSONResponse(err.to_response().model_dump(), status_code=err.status_code)


def _from_validation_errors(errors: Any) -> OpenAIError:
    """Report the first pydantic error, naming its top-level body field."""
    first: Mapping[str, Any] = errors[0] if errors else {}
    if first.get("type") == "json_invalid":
        detail = (first.get("ctx") or {}).get("error", "")
        return OpenAIError(f"Malformed JSON request body: {detail}".rstrip(": "))
    cause = (first.get("ctx") or {}).get("error")
    loc = [p for p in first.get("loc", ()) if p != "body"]
    param = getattr(cause, "param", None) or (loc[0] if loc and isinstance(loc[0], str) else None)
    if isinstance(cause, ValueError):
        message = str(cause)
    else:
        message = str(first.get("msg", "invalid request"))
        if first.get("type") == "missing" and param is None:
            message = "Request body is missing or not a JSON object."
        elif param is not None:
            message = f"{param}: {message}"
    return OpenAIError(message, param=param)


async def _handle_openai_error(request: Request, exc: Exception) -> JSONResponse:
    return error_json(to_openai_error(exc))


async def _handle_value_error(request: Request, exc: Exception) -> JSONResponse:
    err = to_openai_error(exc)
    if err.status_code >= 500:
        logger.exception("unhandled error for %s %s", request.method, request.url.path, exc_info=exc)
    return error_json(err)


class CatchAllMiddleware:
    """Turn exceptions that escape the app into an OpenAI 500 body.

    Starlette's own `Exception` handler re-raises after responding, which would
    log twice and crash in-process test clients; this ASGI wrapper answers and
    stops. If the response has already started (a stream), it can only re-raise.
    """

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def tracking_send(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, receive, tracking_send)
        except Exception:
            logger.exception("unhandled error for %s %s", scope.get("method"), scope.get("path"))
            if started:
                raise
            await error_json(internal_error())(scope, receive, send)


def install_exception_handlers(app: FastAPI) -> None:
    """Register the handlers above on `app` (call once, before serving)."""
    app.add_exception_handler(OpenAIError, _handle_openai_error)
    app.add_exception_handler(RequestValidationError, _handle_openai_error)
    app.add_exception_handler(ValueError, _handle_value_error)
    app.add_middleware(CatchAllMiddleware)
