"""Single-process OpenAI-compatible HTTP server around one `AsyncLLM`.

`build_app` wires the framework-independent handlers of `serving.py` into
FastAPI (the routes and guards of `routes.py`, shared with the elastic server's
ingress, plus this server's own status, health and adapter routes);
`run_single_server` builds the engine and runs uvicorn until SIGINT or SIGTERM,
then stops the engine loop.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import socket
import sys
from types import FrameType
from typing import TYPE_CHECKING, Any

import uvicorn
from fastapi import FastAPI
from fastapi.responses import JSONResponse, Response

from elasticmoe.adapters.esft import EsftAdapter
from elasticmoe.adapters.lora import LoraAdapter
from elasticmoe.engine.async_llm import AsyncLLM
from elasticmoe.entrypoints.listen_address import AddressUnavailable, bind_address
from elasticmoe.entrypoints.openai.access import AccessPolicy
from elasticmoe.entrypoints.openai.adapters_api import add_adapter_routes
from elasticmoe.entrypoints.openai.drain import Drainer, add_drain_route
from elasticmoe.entrypoints.openai.engine_adapters import EngineAdapterHost
from elasticmoe.entrypoints.openai.errors import OpenAIError, error_json, install_exception_handlers
from elasticmoe.entrypoints.openai.metrics import ExpertCacheCollector, KVCacheCollector, ServerMetrics
from elasticmoe.entrypoints.openai.routes import add_openai_routes, install_guards
from elasticmoe.entrypoints.openai.serving import OpenAIServing
from elasticmoe.entrypoints.serve_settings import ServeSettings
from elasticmoe.utils.gc_heap import freeze_startup_heap

if TYPE_CHECKING:
    from elasticmoe.config import EngineConfig

logger = logging.getLogger(__name__)

_ENDPOINTS = frozenset(
    {"/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/ready", "/metrics", "/admin/adapters",
     "/admin/drain", "/admin/status"}
)


def build_app(
    async_llm: AsyncLLM,
    served_model_name: str,
    access: AccessPolicy | None = None,
    drainer: Drainer | None = None,
    drain_timeout_s: float = 30.0,
    reasoning_parser: str | None = None,
) -> FastAPI:
    """The OpenAI-compatible app with the adapter admin API. The caller owns `async_llm`
    (starts and shuts it down) and `drainer` (SIGTERM)."""
    app = FastAPI(title="ElasticMoE", summary="OpenAI-compatible MoE serving (single process)")
    metrics = ServerMetrics(lambda: async_llm.num_running, lambda: async_llm.num_waiting)
    serving = OpenAIServing(async_llm, served_model_name, observer=metrics, reasoning_parser=reasoning_parser)
    drainer = drainer or Drainer()
    install_exception_handlers(app)
    install_guards(app, access or AccessPolicy(), drainer, metrics, _ENDPOINTS)
    app.state.serving = serving
    app.state.metrics = metrics
    app.state.drainer = drainer
    add_openai_routes(app, serving)
    add_drain_route(app, drainer, drain_timeout_s)
    engine: Any = async_llm.engine
    add_adapter_routes(app, EngineAdapterHost(async_llm), served_model_name)
    offload = getattr(engine, "offload", None)
    if offload is not None:
        metrics.registry.register(ExpertCacheCollector(offload.stats))
    blocks = getattr(engine, "block_manager", None)
    if blocks is not None:
        metrics.registry.register(KVCacheCollector(blocks.stats))

    @app.get("/admin/status")
    async def status() -> Response:
        """What the engine runs with and what its queue and caches hold now."""
        body: dict[str, Any] = {"model": served_model_name, "running": async_llm.num_running,
                                "waiting": async_llm.num_waiting}
        compute_info = getattr(engine, "compute_info", None)
        if compute_info is not None:
            body["compute"] = compute_info()
        if blocks is not None:
            body["kv_cache"] = blocks.stats()
        if offload is not None:
            body["expert_cache"] = offload.stats()
        lora = getattr(getattr(engine, "adapters", None), "lora", None)
        if lora is not None:  # the slots: how many, what each takes and holds, how many are filled
            body["lora"] = {**lora.occupancy(), "target_modules": lora.target_modules}
        return JSONResponse(body)

    @app.get("/health")
    async def health() -> Response:
        try:
            async_llm.check_health()
        except Exception as exc:
            logger.warning("health check failed: %s", exc)
            return error_json(OpenAIError("Engine is not healthy.", status_code=503))
        return JSONResponse({"status": "ok"})

    @app.get("/ready")
    async def ready() -> Response:
        if drainer.is_draining:
            return error_json(OpenAIError("The server is draining.", status_code=503))
        if not async_llm.is_ready:
            return error_json(OpenAIError("Engine is not ready.", status_code=503))
        return JSONResponse({"status": "ready"})

    @app.get("/metrics")
    async def show_metrics() -> Response:
        body, content_type = metrics.render()
        return Response(body, media_type=content_type)

    return app


class _StartupError(Exception):
    """A flag's value the server cannot start with (an adapter that does not load)."""


class _Terminated(Exception):
    pass


class DrainingServer(uvicorn.Server):
    """uvicorn, but the first SIGTERM/SIGINT drains (new `/v1/*` requests get 503, those in flight
    finish, up to `drain_timeout_s`) before the usual graceful shutdown; a second SIGINT forces exit."""

    def __init__(self, config: uvicorn.Config, drainer: Drainer, drain_timeout_s: float) -> None:
        super().__init__(config)
        self.drainer = drainer
        self.drain_timeout_s = drain_timeout_s
        self._drain_task: asyncio.Task[None] | None = None

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self._drain_task is not None or self.should_exit:
            super().handle_exit(sig, frame)
            return
        self._captured_signals.append(sig)  # re-raised by uvicorn after shutdown, as for any signal
        logger.info("received %s: draining for up to %.0f s", signal.Signals(sig).name, self.drain_timeout_s)
        self._drain_task = asyncio.get_running_loop().create_task(self._drain_then_exit())

    async def _drain_then_exit(self) -> None:
        result = await self.drainer.drain(self.drain_timeout_s)
        logger.info("drain finished: %s", result)
        self.should_exit = True


def _raise_terminated(signum: int, frame: FrameType | None) -> None:
    raise _Terminated()


def run_single_server(settings: ServeSettings, host: str = "127.0.0.1", port: int = 8000,
                      log_level: str = "info") -> int:
    """Load the model (and the adapters to load at start), serve it until SIGINT/SIGTERM, then
    stop the engine. Returns an exit code."""
    import torch  # noqa: F401 - fail early and clearly if torch is missing

    config = settings.engine_options().engine_config(settings.model_dir)
    try:  # NOTE: bound before the model loads, so an address in use is refused at once; uvicorn listens on it
        sock = bind_address(host, port)
    except AddressUnavailable as exc:
        print(f"error: --host/--port: {exc.strerror}", file=sys.stderr)
        return 2
    with sock:
        return _serve_on(sock, settings, config, log_level)


def _serve_on(sock: socket.socket, settings: ServeSettings, config: EngineConfig, log_level: str) -> int:
    from elasticmoe.engine.llm_engine import LLMEngine

    name, access, shutdown_timeout_s = settings.model_name, settings.access, settings.shutdown_timeout_s
    logger.info("loading %s as %r", settings.model_dir, name)

    def build() -> LLMEngine:  # on the engine's loop thread (AsyncLLM.start)
        engine = LLMEngine(config)
        try:
            load_adapters(engine)
        except BaseException:
            engine.close()  # its own threads (expert prefetching) end with the failed start
            raise
        return engine

    def load_adapters(engine: LLMEngine) -> None:
        for adapter_name, path in settings.esft_adapters:
            try:
                adapter = EsftAdapter.open(adapter_name, path, engine.model_config)
                engine.adapters.load_esft(adapter_name, adapter.config.experts, adapter.expert_weights, files=adapter)
                adapter.close()
            except (ValueError, RuntimeError) as exc:  # AdapterError, AdapterLimitError, ...
                raise _StartupError(f"--esft-adapter {adapter_name}={path}: {exc}") from exc
            logger.info("ESFT adapter %r loaded from %s", adapter_name, path)
        for adapter_name, path in settings.lora_adapters:
            try:
                lora = LoraAdapter.open(adapter_name, path, engine.model_config)
                engine.adapters.load_lora(adapter_name, lora.modules, lora.weights, lora.config.scaling)
            except (ValueError, RuntimeError) as exc:
                raise _StartupError(f"--lora-adapter {adapter_name}={path}: {exc}") from exc
            logger.info("LoRA adapter %r loaded from %s", adapter_name, path)

    async_llm = AsyncLLM()
    try:
        async_llm.start(build)
    except (_StartupError, ValueError) as exc:  # ValueError: a setting the model cannot run with
        print(f"error: {exc}", file=sys.stderr)  # (e.g. an expert cache below top-k)
        return 2
    drainer = Drainer()
    app = build_app(async_llm, name, access, drainer, shutdown_timeout_s, settings.reasoning_parser)
    server = DrainingServer(
        uvicorn.Config(app, log_level=log_level, timeout_graceful_shutdown=10,
                       h11_max_incomplete_event_size=access.max_header_bytes if access else None),
        drainer, shutdown_timeout_s,
    )
    freeze_startup_heap("server")  # the engine, model and app live as long as the process
    # NOTE: uvicorn shuts down gracefully on SIGINT/SIGTERM and then re-raises the signal with the
    # previous handler; make SIGTERM an exception here so that the engine is still stopped below.
    previous = signal.signal(signal.SIGTERM, _raise_terminated)
    try:
        server.run(sockets=[sock])
    except (KeyboardInterrupt, _Terminated):
        logger.info("received shutdown signal")
    finally:
        signal.signal(signal.SIGTERM, previous)
        async_llm.shutdown()
    return 0
