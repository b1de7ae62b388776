"""Admin API for adapters, shared by the single-process server and the coordinator.

    POST   /admin/adapters {"name", "path", "type": "esft"|"lora", "usage_probability"}   load (201)
    DELETE /admin/adapters/{name}                       unload once its requests finish (202/200)
    GET    /admin/adapters                              what is loaded

Requests then pick an adapter with the OpenAI `model` field (`/v1/models` lists
them). Errors are OpenAI-format: 400 naming the field (bad name, bad path, an
adapter the base cannot take), 404 (unknown adapter), 409 (name taken, no free
slot, too many experts per layer for a slot: the message names the limit).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from http import HTTPStatus
from pathlib import Path
from typing import Any, Literal, Protocol

from fastapi import FastAPI
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, Field, field_validator

from elasticmoe.adapters.esft import EXPERT_CFG, AdapterError, EsftAdapter
from elasticmoe.adapters.lora import LoraAdapter
from elasticmoe.adapters.lora_router import CONFIG as ROUTER_CONFIG
from elasticmoe.adapters.lora_router import LoraRouter
from elasticmoe.config import ModelConfig
from elasticmoe.entrypoints.openai.errors import OpenAIError
from elasticmoe.errors import AdapterConflictError, AdapterLimitError, UnknownAdapterError, unwrap_remote
from elasticmoe.utils.passing_thread import in_passing_thread

logger = logging.getLogger(__name__)

_NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._:-]*$"
MAX_PATH_CHARS = 4096  # PATH_MAX
MAX_PATH_COMPONENT_BYTES = 255  # NAME_MAX


class LoadAdapterRequest(BaseModel):
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
    """Where adapters are loaded: one engine, or every rank of the active instance."""

    async def load_esft(self, adapter: EsftAdapter, usage_probability: float | None = None) -> dict[str, Any]: ...
    async def load_lora(self, adapter: LoraAdapter, usage_probability: float | None = None) -> dict[str, Any]: ...
    async def load_router(self, name: str, router: LoraRouter,
                          usage_probability: float | None = None) -> dict[str, Any]: ...
    async def unload(self, name: str) -> bool: ...  # True: unloaded now; False: once its requests finish
    async def describe(self) -> list[dict[str, Any]]: ...


def adapter_kind(path: str) -> str:
    """The kind of the adapter directory at `path`, read from its files; `AdapterError` naming
    `path` when none is recognised (the same answer whether the path exists or not)."""
    root = Path(path)
    for marker, kind in (("adapter_config.json", "lora"), (EXPERT_CFG, "esft"), (ROUTER_CONFIG, "lora_router")):
        if (root / marker).is_file():
            return kind
    raise AdapterError("path", f"{root}: no adapter here (want a directory with adapter_config.json, {EXPERT_CFG} "
                       f"or {ROUTER_CONFIG}, or give type)")


def read_esft_adapter(name: str, path: str, model_config: ModelConfig) -> EsftAdapter:
    """Open and validate an adapter directory (blocking: run it in a thread)."""
    return EsftAdapter.open(name, path, model_config)


def read_lora_adapter(name: str, path: str, model_config: ModelConfig) -> LoraAdapter:
    """Open and validate a PEFT LoRA directory (blocking: run it in a thread)."""
    return LoraAdapter.open(name, path, model_config)


def add_adapter_routes(
    app: FastAPI, host: AdapterHost, model_config: Callable[[], ModelConfig], base_name: str
) -> None:
    """The adapter admin routes; `model_config()` gives the base model's config (read on first load)."""
    @app.post("/admin/adapters", status_code=201)
    async def load_adapter(body: LoadAdapterRequest) -> Response:
        if body.name == base_name:
            raise OpenAIError(f"name: {body.name!r} is the base model's id", status_code=HTTPStatus.CONFLICT,
                              param="name")
        kind: str | None = body.type
        try:
            if kind is None:
                kind = await asyncio.to_thread(adapter_kind, body.path)
            p = body.usage_probability
            if kind == "lora_router":
                router = await asyncio.to_thread(LoraRouter.open, body.path)
                info = await host.load_router(body.name, router, p)
            elif kind == "lora":
                lora = await asyncio.to_thread(read_lora_adapter, body.name, body.path, model_config())
                info = await host.load_lora(lora, p)
            else:
                adapter = await asyncio.to_thread(read_esft_adapter, body.name, body.path, model_config())
                info = await host.load_esft(adapter, p)
        except (ValueError, RuntimeError) as exc:
            raise _adapter_error(unwrap_remote(exc)) from None
        logger.info("adapter %r loaded from %s", body.name, body.path)
        return JSONResponse({"name": body.name, "type": kind, "state": "loaded", **info}, status_code=201)

    @app.delete("/admin/adapters/{name}")
    async def unload_adapter(name: str) -> Response:
        try:
            done = await host.unload(name)
        except UnknownAdapterError as exc:
            raise OpenAIError(f"No adapter {name!r} is loaded.", status_code=HTTPStatus.NOT_FOUND,
                              param="name") from exc
        except AdapterConflictError as exc:  # others depend on it (learned routers over it)
            raise OpenAIError(str(unwrap_remote(exc)), status_code=HTTPStatus.CONFLICT, param="name") from exc
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
    if isinstance(exc, ValueError):  # an adapter that does not fit the base (e.g. a dense layer)
        return OpenAIError(str(exc), param=getattr(exc, "param", None) or "path")
    logger.error("adapter load failed: %r", exc)
    return OpenAIError("Internal server error.", status_code=HTTPStatus.INTERNAL_SERVER_ERROR)


class EngineAdapterHost:
    """Adapters of one `AsyncLLM`'s engine. The weights are read from disk in a worker thread;
    the engine thread only copies them into their slot rows, so serving does not pause. ESFT
    adapters beyond the slots are registered on disk and swapped in when a request needs one
    (`engine.esft_disk_tier`: that read is on the engine thread)."""

    def __init__(self, async_llm: Any) -> None:
        self.async_llm = async_llm

    @property
    def engine(self) -> Any:
        return self.async_llm.engine

    async def load_esft(self, adapter: EsftAdapter, usage_probability: float | None = None) -> dict[str, Any]:
        engine, experts = self.engine, adapter.config.experts
        dtype = engine.config.dtype
        rank, placement = engine.config.ep_rank, engine.placement
        weights = await in_passing_thread(read_expert_weights, adapter, rank, placement.expert_to_rank, dtype)
        adapter.close()  # read again from its files only if it is swapped out and back
        slot = await self.async_llm.run_on_loop(
            lambda: engine.adapters.load_esft(adapter.name, experts, lambda layer, e, _: weights[(layer, e)],
                                              usage_probability=usage_probability, files=adapter)
        )
        return {"slot": slot, "num_experts": sum(len(v) for v in experts.values())}

    async def load_lora(self, adapter: LoraAdapter, usage_probability: float | None = None) -> dict[str, Any]:
        engine = self.engine
        dtype = engine.config.dtype
        factors = await in_passing_thread(lambda: {m: adapter.weights(m, dtype) for m in adapter.modules})
        slot = await self.async_llm.run_on_loop(
            lambda: engine.adapters.load_lora(adapter.name, adapter.modules, lambda m, _: factors[m],
                                             adapter.config.scaling, usage_probability=usage_probability)
        )
        return {"slot": slot, "rank": adapter.config.r, "num_modules": len(adapter.modules)}

    async def load_router(self, name: str, router: LoraRouter, usage_probability: float | None = None) -> dict[str, Any]:
        engine = self.engine
        await self.async_llm.run_on_loop(lambda: engine.adapters.load_router(name, router, usage_probability))
        return {"adapters": list(router.adapters), "top_k": router.top_k}

    async def unload(self, name: str) -> bool:
        engine = self.engine
        return bool(await self.async_llm.run_on_loop(lambda: engine.adapters.unload(name)))

    async def describe(self) -> list[dict[str, Any]]:
        engine = self.engine
        return list(await self.async_llm.run_on_loop(engine.adapters.describe))


def read_expert_weights(
    adapter: EsftAdapter, rank: int, expert_to_rank: tuple[int, ...], dtype: Any
) -> dict[tuple[int, int], tuple[Any, Any]]:
    """(layer, expert) -> (w13, w2) of the tuned experts `rank` holds (blocking)."""
    return {
        (layer, e): adapter.expert_weights(layer, e, dtype)
        for layer, ids in adapter.config.experts.items()
        for e in ids
        if expert_to_rank[e] == rank
    }
