"""OpenAI error bodies and the FastAPI exception handlers that produce them.

Every error leaves the server as `{"error": {"message", "type", "param", "code"}}`
with a matching HTTP status:

- 400 `BadRequestError`: request validation (with `param` = offending top-level
  field), malformed JSON, `ValueError`s that carry `.param` (`SamplingParamError`,
  engine input errors);
- 404 `NotFoundError`: unknown model (`param="model"`), unknown route; 405 for a known
  route with the wrong method; a body that cannot be parsed at all (too deeply nested) is a 400;
- 500 `InternalServerError`: anything unexpected; the message never contains
  exception text, the traceback goes to the log.

The OpenAPI document says the same: every operation lists 400 (not FastAPI's 422) and a
default response, both in this error format.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from http import HTTPStatus
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from elasticmoe.entrypoints.openai.responses import ErrorInfo, ErrorResponse
from elasticmoe.errors import (
    AdapterConflictError,
    AdapterLimitError,
    AdapterUnavailableError,
    UnknownAdapterError,
    unwrap_remote,
)

logger = logging.getLogger(__name__)

_TYPES = {
    400: "BadRequestError",
    404: "NotFoundError",
    405: "MethodNotAllowedError",
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

    def __reduce__(self):
        # Crosses process boundaries (the coordinator answers the ingress) with every field intact;
        # subclasses with other constructors come back as plain `OpenAIError`s of the same content.
        return (_rebuild_openai_error, (self.message, self.status_code, self.type, self.param))

    def to_response(self) -> ErrorResponse:
        return ErrorResponse(
            error=ErrorInfo(message=self.message, type=self.type, param=self.param, code=self.status_code)
        )


def _rebuild_openai_error(message: str, status_code: int, type: str, param: str | None) -> OpenAIError:
    return OpenAIError(message, status_code=status_code, type=type, param=param)


def model_not_found(model: str) -> OpenAIError:
    return OpenAIError(
        f"The model `{model}` does not exist.", status_code=HTTPStatus.NOT_FOUND, param="model"
    )


def internal_error() -> OpenAIError:
    return OpenAIError("Internal server error.", status_code=HTTPStatus.INTERNAL_SERVER_ERROR)


def to_openai_error(exc: BaseException) -> OpenAIError:
    """Classify any exception: known client errors keep their message, the rest become a bare 500."""
    exc = unwrap_remote(exc)
    if isinstance(exc, OpenAIError):
        return exc
    if isinstance(exc, RequestValidationError):
        return _from_validation_errors(exc.errors())
    if isinstance(exc, UnknownAdapterError):  # unloaded between the model check and the engine
        return model_not_found(exc.adapter)
    if isinstance(exc, AdapterConflictError | AdapterLimitError):
        return OpenAIError(str(exc), status_code=HTTPStatus.CONFLICT, param="name")
    if isinstance(exc, AdapterUnavailableError):  # a rank hung or died during an adapter change
        return OpenAIError(str(exc), status_code=HTTPStatus.SERVICE_UNAVAILABLE)
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


async def _handle_http_exception(request: Request, exc: Exception) -> JSONResponse:
    """Starlette's own errors (unknown route, wrong method, an unparsable body) in OpenAI's format."""
    assert isinstance(exc, StarletteHTTPException)
    status = exc.status_code
    if status == HTTPStatus.NOT_FOUND:
        message = f"Unknown route: {request.method} {request.url.path}."
    elif status == HTTPStatus.METHOD_NOT_ALLOWED:
        message = f"Method {request.method} is not allowed on {request.url.path}."
    elif status == HTTPStatus.BAD_REQUEST:
        message = "Malformed request body: it could not be parsed as JSON (too deeply nested?)."
    else:
        message = str(exc.detail) if status < 500 else "Internal server error."
    response = error_json(OpenAIError(message, status_code=status))
    for name, value in (exc.headers or {}).items():
        response.headers[name] = value
    return response


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
    app.add_exception_handler(StarletteHTTPException, _handle_http_exception)
    app.add_exception_handler(ValueError, _handle_value_error)
    app.add_middleware(CatchAllMiddleware)
    app.openapi = lambda: _openapi_in_openai_errors(app)  # type: ignore[method-assign]


_ERROR_REF = {"application/json": {"schema": {"$ref": "#/components/schemas/ErrorResponse"}}}


def _openapi_in_openai_errors(app: FastAPI) -> dict[str, Any]:
    """FastAPI's document with its 422 replaced by the 400 this server sends, and a default
    response in OpenAI's error format on every operation (401/404/405/409/413/503 ...)."""
    if app.openapi_schema is not None:
        return app.openapi_schema
    schema = get_openapi(title=app.title, version=app.version, summary=app.summary, routes=app.routes)
    components = schema.setdefault("components", {}).setdefault("schemas", {})
    error_schema = ErrorResponse.model_json_schema(ref_template="#/components/schemas/{model}")
    components.update(error_schema.pop("$defs", {}))
    components["ErrorResponse"] = error_schema
    for name in ("HTTPValidationError", "ValidationError"):
        components.pop(name, None)
    for operations in schema.get("paths", {}).values():
        for operation in operations.values():
            responses = operation.setdefault("responses", {})
            if responses.pop("422", None) is not None:
                responses["400"] = {"description": "Invalid request; `param` names the field.", "content": _ERROR_REF}
            responses.setdefault("default", {"description": "An error, in OpenAI's format.", "content": _ERROR_REF})
    app.openapi_schema = schema
    return schema
