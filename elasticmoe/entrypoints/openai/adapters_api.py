"""Admin API for adapters, shared by the single-process server and the coordinator.

    POST   /admin/adapters {"name", "path", "type": "esft"|"lora", "usage_probability"}   load (201)
    DELETE /admin/adapters/{name}                       unload once its requests finish (202/200)
    GET    /admin/adapters                              what is loaded

Requests then pick an adapter with the OpenAI `model` field (`/v1/models` lists
them). Errors are OpenAI-format: 400 naming the field (bad name, bad path, an
adapter the base cannot take), 404 (unknown adapter), 409 (name taken, no free
slot, too many experts per layer for a slot: the message names the limit).

The routes check the request and tell the adapter's kind from its marker file; the host opens and
validates the files where it loads them (the engine's process, or the elastic server's
coordinator): this module imports no adapter format (nor torch), and the elastic server's ingress
reads no adapter file.
"""

from __future__ import annotations

import asyncio
import logging
from http import HTTPStatus
from typing import Any, Literal, Protocol

from fastapi import FastAPI
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, Field, field_validator

from elasticmoe.adapters.kinds import adapter_kind
from elasticmoe.entrypoints.openai.errors import OpenAIError
from elasticmoe.errors import (
    AdapterConflictError,
    AdapterError,
    AdapterLimitError,
    AdapterUnavailableError,
    UnknownAdapterError,
    unwrap_remote,
)

logger = logging.getLogger(__name__)

_NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._:-]*$"
MAX_PATH_CHARS = 4096  # PATH_MAX
MAX_PATH_COMPONENT_BYTES = 255  # NAME_MAX


class LoadAdapterRequest(BaseModel):
    # An admin request refuses fields it does not know: a typo, or a setting sent here that only a
    # restart changes, must not look applied.
    model_config = ConfigDict(extra="forbid")

    name: str = Field(min_length=1, max_length=128, pattern=_NAME_PATTERN,
                      description="Model id clients pass as `model` to use the adapter.")
    path: str = Field(min_length=1, max_length=MAX_PATH_CHARS,
                      description="Adapter directory on the server (ESFT: expert_cfg.json + safetensors; LoRA: "
                      "PEFT's adapter_config.json + adapter_model.safetensors). At most 4096 characters, each "
                      "path component at most 255 bytes.")
    type: Literal["esft", "lora", "lora_router"] | None = Field(
        None, description="Adapter kind; omitted: read from the files (PEFT's adapter_config.json: lora; "
        "expert_cfg.json: esft; router_config.json: lora_router). lora_router: a learned per-token router over "
        "loaded LoRA adapters, used with lora_routing={type: learned, router: name}."
    )
    usage_probability: float | None = Field(
        None, ge=0.0, le=1.0, allow_inf_nan=False,
        description="The chance a request uses this adapter (CoServe §4.3): what the eviction keeps longest. "
        "Default: the server's profile (serve --profile), else the observed request rate.")


    @field_validator("path")
    @classmethod
    def _a_path_the_os_takes(cls, v: str) -> str:
        # Refused here instead of an OSError (ENAMETOOLONG, NUL) deep in a file open.
        if "\x00" in v:
            raise AdapterError("path", "must not contain NUL characters")
        try:
            too_long = any(len(part.encode("utf-8")) > MAX_PATH_COMPONENT_BYTES for part in v.split("/"))
        except UnicodeEncodeError:
            raise AdapterError("path", "must be valid Unicode text") from None
        if too_long:
            raise AdapterError("path", f"each path component must be at most {MAX_PATH_COMPONENT_BYTES} bytes")
        return v


class AdapterHost(Protocol):
    """Where adapters are loaded: one engine, or every rank of the active instance. Each load
    opens and validates the directory at `path` (an `AdapterError` naming the field when the base
    cannot take it) before anything is loaded."""

    async def load_esft(self, name: str, path: str, usage_probability: float | None = None) -> dict[str, Any]: ...
    async def load_lora(self, name: str, path: str, usage_probability: float | None = None) -> dict[str, Any]: ...
    async def load_router(self, name: str, path: str, usage_probability: float | None = None) -> dict[str, Any]: ...
    async def unload(self, name: str) -> bool: ...  # True: unloaded now; False: once its requests finish
    async def describe(self) -> list[dict[str, Any]]: ...


def add_adapter_routes(app: FastAPI, host: AdapterHost, base_name: str) -> None:
    """The adapter admin routes over `host`; `base_name` is the base model's id (no adapter takes it)."""
    @app.post("/admin/adapters", status_code=201)
    async def load_adapter(body: LoadAdapterRequest) -> Response:
        if body.name == base_name:
            raise OpenAIError(f"name: {body.name!r} is the base model's id", status_code=HTTPStatus.CONFLICT,
                              param="name")
        kind: str | None = body.type
        try:
            if kind is None:
                kind = await asyncio.to_thread(adapter_kind, body.path)
            name, path, p = body.name, body.path, body.usage_probability
            if kind == "lora_router":
                info = await host.load_router(name, path, p)
            elif kind == "lora":
                info = await host.load_lora(name, path, p)
            else:
                info = await host.load_esft(name, path, p)
        except (ValueError, RuntimeError) as exc:
            raise _adapter_error(unwrap_remote(exc)) from None
        logger.info("adapter %r loaded from %s", body.name, body.path)
        return JSONResponse({"name": body.name, "type": kind, "state": "loaded", **info}, status_code=201)

    @app.delete("/admin/adapters/{name}")
    async def unload_adapter(name: str) -> Response:
        try:
            done = await host.unload(name)
        except UnknownAdapterError as exc:
            raise OpenAIError(f"No adapter {name[:128]!r} is loaded.", status_code=HTTPStatus.NOT_FOUND,
                              param="name") from exc
        except AdapterConflictError as exc:  # others depend on it (learned routers over it)
            raise OpenAIError(str(unwrap_remote(exc)), status_code=HTTPStatus.CONFLICT, param="name") from exc
        except AdapterUnavailableError as exc:  # a rank hung or died: it stays loaded; retry
            raise OpenAIError(str(exc), status_code=HTTPStatus.SERVICE_UNAVAILABLE) from exc
        state = "unloaded" if done else "unloading"
        return JSONResponse({"name": name, "state": state}, status_code=200 if done else 202)

    @app.get("/admin/adapters")
    async def list_adapters() -> Response:
        return JSONResponse({"adapters": await host.describe()})


def _adapter_error(exc: BaseException) -> Exception:
    """A failed load as the client sees it: its own message (never a remote traceback)."""
    if isinstance(exc, AdapterError):
        return OpenAIError(str(exc), param=exc.param)
    if isinstance(exc, AdapterConflictError | AdapterLimitError):
        return OpenAIError(str(exc), status_code=HTTPStatus.CONFLICT, param="name")
    if isinstance(exc, AdapterUnavailableError):
        return OpenAIError(str(exc), status_code=HTTPStatus.SERVICE_UNAVAILABLE)
    if isinstance(exc, ValueError):  # an adapter that does not fit the base (e.g. a dense layer)
        return OpenAIError(str(exc), param=getattr(exc, "param", None) or "path")
    logger.error("adapter load failed: %r", exc)
    return OpenAIError("Internal server error.", status_code=HTTPStatus.INTERNAL_SERVER_ERROR)
