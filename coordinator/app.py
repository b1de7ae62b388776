"""The coordinator's HTTP ingress: a Ray Serve deployment serving a FastAPI app.

Routes: the OpenAI API of `elasticmoe.entrypoints.openai` (the same handlers
and route wiring as the single-process server, over a `RouterEngineClient`),
`/health` (200 only if every rank of the active instance has a live step loop),
`/ready`, `/metrics`, `GET /admin/status`, and the scale API: `POST /admin/scale
{"dp": N, "strategy": "elastic"}` (202 with the event id; the scale runs in a
background thread, see `coordinator.scaler` and `coordinator.strategies`) and
`GET /admin/scale/{event_id}`; `GET|POST /admin/autoscaler` (the SLO-driven autoscaler of
`coordinator.autoscaler`; a manual scale pauses it) and `POST /admin/drain`. API keys,
size limits and the drain (503 for new `/v1/*` requests) are middleware shared with the
single-process server (`install_guards`).

The FastAPI app is built per replica after the constructor
(`__serve_build_asgi_app__`, Serve's late-bound `@serve.ingress()`), so its
routes close over the replica's own cluster, engine client and metrics.
NOTE: run exactly one replica: it owns the HMM and the instances.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
from typing import Any

import ray
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, Field
from ray import serve

from coordinator.autoscale_loop import AutoscaleLoop
from coordinator.autoscaler import Autoscaler
from coordinator.cluster import ClusterManager
from coordinator.config import CoordinatorConfig
from coordinator.engine_client import QueueFull, RouterEngineClient
from coordinator.healer import INSTANCE, Healer
from coordinator.loop_caller import loop_caller
from coordinator.metrics import CoordinatorMetrics
from coordinator.scale_events import ScaleConflict, ScaleEvent
from coordinator.scaler import Scaler
from coordinator.slo import SloTracker
from coordinator.strategies import DEFAULT_STRATEGY, STRATEGIES
from elasticmoe.config import ModelConfig
from elasticmoe.entrypoints.openai.adapters_api import add_adapter_routes, read_esft_adapter
from elasticmoe.entrypoints.openai.api_server import add_openai_routes, install_guards
from elasticmoe.entrypoints.openai.drain import Drainer, add_drain_route
from elasticmoe.entrypoints.openai.errors import OpenAIError, error_json, install_exception_handlers
from elasticmoe.entrypoints.openai.serving import OpenAIServing, RequestStats, ServingObserver
from elasticmoe.errors import describe_error
from elasticmoe.sampling_params import MAX_INT32
from elasticmoe.tokenizer import Tokenizer
from hmm.lifeline import in_ray_actor, watch_parent
from imm.handover import HandoverRoutes

logger = logging.getLogger(__name__)

ENDPOINTS = frozenset(
    {
        "/v1/completions",
        "/v1/chat/completions",
        "/v1/models",
        "/health",
        "/ready",
        "/metrics",
        "/admin/status",
        "/admin/devices",
        "/admin/scale",
        "/admin/adapters",
        "/admin/autoscaler",
        "/admin/drain",
    }
)


async def _handle_queue_full(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, QueueFull)
    response = error_json(exc)
    response.headers["Retry-After"] = str(exc.retry_after_s)
    return response


class ScaleRequest(BaseModel):
    dp: int = Field(strict=True, ge=1, le=MAX_INT32,
                    description="Target data-/expert-parallel degree (ranks, one per device).")
    strategy: str = Field(
        DEFAULT_STRATEGY, description=f"How to scale: one of {', '.join(STRATEGIES)} (coordinator.strategies)."
    )


class ScaleRunner:
    """Starts scales in a background thread (one at a time); `join` waits for the running one."""

    def __init__(self, scaler: Scaler) -> None:
        self.scaler = scaler
        self.thread: threading.Thread | None = None

    def start(self, dp: int, strategy: str = DEFAULT_STRATEGY) -> str:
        """The new event's id. Raises `OpenAIError`: 400 (bad dp/strategy), 409 (a scale runs), 503."""
        try:
            event = self.scaler.start(dp, strategy)
        except ValueError as exc:
            param = "strategy" if str(exc).startswith("strategy") else "dp"
            raise OpenAIError(str(exc), param=param) from exc
        except ScaleConflict as exc:
            raise OpenAIError(str(exc), status_code=409, param="dp") from exc
        except RuntimeError as exc:
            raise OpenAIError(str(exc), status_code=503) from exc
        self.thread = threading.Thread(target=self.scaler.run, args=(event,), name=event.event_id, daemon=True)
        self.thread.start()
        return event.event_id

    def join(self, timeout_s: float = 120.0) -> None:
        if self.thread is not None:
            self.thread.join(timeout_s)


class AutoscalerUpdate(BaseModel):
    enabled: bool = Field(strict=True, description="true: (re)start deciding; false: stop.")


class _Observers:
    """Finished requests go to the metrics and to the SLO estimator."""

    def __init__(self, *observers: ServingObserver) -> None:
        self.observers = observers

    def on_request_finished(self, stats: RequestStats) -> None:
        for observer in self.observers:
            observer.on_request_finished(stats)


def build_app(
    cluster: ClusterManager,
    engine: RouterEngineClient,
    metrics: CoordinatorMetrics,
    scales: ScaleRunner,
    autoscale: AutoscaleLoop,
    drainer: Drainer,
    healer: Healer,
) -> FastAPI:
    """The coordinator's FastAPI app over a started `cluster`."""
    app = FastAPI(title="ElasticMoE", summary="OpenAI-compatible elastic MoE serving (coordinator)")
    config = cluster.config

    serving = OpenAIServing(engine, config.model_name, observer=_Observers(metrics, autoscale.tracker))
    install_exception_handlers(app)
    app.add_exception_handler(QueueFull, _handle_queue_full)
    install_guards(app, config.access, drainer, metrics.server, ENDPOINTS)
    add_openai_routes(app, serving)
    add_drain_route(app, drainer, config.shutdown_timeout_s)

    @app.get("/health")
    async def health() -> Response:
        """Liveness: 200 while every rank's loop runs ("ok") or while what failed is being repaired
        ("degraded", with the faults); 503 once repairs keep failing (a restart is needed)."""
        faults = dict(healer.faults)
        if healer.has_given_up:
            return JSONResponse({"status": "unhealthy", "faults": faults}, status_code=503)
        try:
            await cluster.check_health()
        except Exception as exc:  # noqa: BLE001 - any failure means a rank is not healthy
            logger.warning("health check failed: %s", describe_error(exc))
            healer.notify()
            faults.setdefault(INSTANCE, describe_error(exc))
        if faults:
            return JSONResponse({"status": "degraded", "faults": faults})
        return JSONResponse({"status": "ok"})

    @app.get("/ready")
    async def ready() -> Response:
        if drainer.is_draining:
            return error_json(OpenAIError("The server is draining.", status_code=503))
        if not healer.is_serving:
            return error_json(OpenAIError("No instance is serving.", status_code=503))
        return JSONResponse({"status": "ready"})

    @app.get("/metrics")
    async def show_metrics() -> Response:
        # Both snapshots at once; one that fails or times out leaves its gauges stale (a stale
        # gauge beats a failed scrape). NOTE: device workers answer after a scale's copies.
        stats, devices = await asyncio.gather(
            cluster.rank_stats(), cluster.device_memory(), return_exceptions=True
        )
        if isinstance(stats, BaseException):
            logger.warning("rank stats unavailable: %r", stats)
        else:
            metrics.refresh(stats)
        if isinstance(devices, BaseException):
            logger.info("device memory unavailable: %r", devices)
        else:
            metrics.refresh_devices(devices)
        metrics.refresh_adapters(cluster.adapter_slots())
        body, content_type = metrics.render()
        return Response(body, media_type=content_type)

    @app.get("/admin/status")
    async def admin_status() -> Response:
        status = await asyncio.to_thread(cluster.status)
        status["requests"] = {"queued": engine.num_queued, "max_queued": engine.max_queued,
                              "held_at_gate": cluster.router.num_held, "rejected": engine.num_rejected,
                              "recovered": engine.num_recovered, "tokens_recomputed": engine.num_tokens_recomputed,
                              "draining": drainer.is_draining}
        status["health"] = {"ready": healer.is_serving, **healer.status()}
        status["scale_events"] = [e.to_dict() for e in cluster.scale_events.all()[-20:]]  # the latest 20
        status["slo"] = autoscale.tracker.snapshot().to_dict()
        status["autoscaler"] = autoscale.policy.status()
        return JSONResponse(status)

    @app.get("/admin/devices")
    async def admin_devices() -> Response:
        """The registered devices (node, state, memory) and the Ray nodes offering devices now."""
        return JSONResponse(await asyncio.to_thread(cluster.devices_report))

    @app.post("/admin/scale", status_code=202)
    async def start_scale(request: ScaleRequest) -> Response:
        """A manual scale; it pauses the autoscaler (an operator's decision wins until resumed)."""
        event_id = scales.start(request.dp, request.strategy)
        policy = autoscale.policy
        if policy.enabled:
            policy.pause(f"manual scale {event_id}; resume with POST /admin/autoscaler")
        return JSONResponse({"event_id": event_id, "autoscaler_paused": policy.enabled}, status_code=202)

    @app.get("/admin/autoscaler")
    async def show_autoscaler() -> Response:
        return JSONResponse({**autoscale.policy.status(), "slo": autoscale.tracker.snapshot().to_dict()})

    @app.post("/admin/autoscaler")
    async def update_autoscaler(update: AutoscalerUpdate) -> Response:
        policy = autoscale.policy
        if update.enabled:
            if drainer.is_draining:
                raise OpenAIError("The server is draining; the autoscaler stays off.", status_code=409,
                                  param="enabled")
            policy.resume()
        else:
            policy.enabled = False
        return JSONResponse(policy.status())

    @app.get("/admin/scale/{event_id}")
    async def show_scale(event_id: str) -> Response:
        event = cluster.scale_events.get(event_id)
        if event is None:
            raise OpenAIError(f"No scale event {event_id!r}.", status_code=404, param="event_id")
        return JSONResponse(event.to_dict())

    return app


@serve.deployment(name="coordinator", num_replicas=1, ray_actor_options={"num_cpus": 0})
@serve.ingress()
class Coordinator:
    """One replica: starts the cluster in its constructor, serves, and frees it on shutdown."""

    async def __init__(self, config: CoordinatorConfig) -> None:  # type: ignore[misc]
        if in_ray_actor():  # exit with the node's raylet (see hmm.lifeline)
            watch_parent()
        # NOTE: the router's gate and snapshot are asyncio objects of this loop; other threads
        # (start-up, scales, repairs) reach them through this caller.
        self.cluster = ClusterManager(config, loop_caller(asyncio.get_running_loop()))
        await asyncio.to_thread(self.cluster.start)
        tokenizer = await asyncio.to_thread(Tokenizer, config.model_dir)
        self.model_config = await asyncio.to_thread(ModelConfig.from_pretrained, config.model_dir)
        routes = HandoverRoutes()
        self.engine = RouterEngineClient(self.cluster.router, tokenizer, config.max_queued, handover_routes=routes,
                                         on_rank_failure=lambda rank: self.healer.notify(rank))
        scaler = Scaler(self.cluster, routes)
        self.healer = Healer(self.cluster, scaler)
        for name, path in config.esft_adapters:  # --esft-adapter: a bad one fails the start
            adapter = await asyncio.to_thread(read_esft_adapter, name, path, self.model_config)
            await self.cluster.adapters.load_esft(adapter)
        for name, path in config.lora_adapters:  # --lora-adapter
            await asyncio.to_thread(self.cluster.adapters.load_lora_blocking, name, path)
        self.scales = ScaleRunner(scaler)
        self.metrics = CoordinatorMetrics(lambda: float(self.engine.num_queued), self._active_dp)
        self.drainer = Drainer()
        tracker = SloTracker(config.autoscale.targets, config.autoscale.window_s)
        self.engine.on_arrival, self.engine.on_failed = tracker.on_arrival, tracker.on_request_failed
        self.autoscale = AutoscaleLoop(
            Autoscaler(config.autoscale, config.num_devices), tracker, self.scales.start,
            lambda: self.cluster.active.dp if self.cluster.active is not None and self.cluster.is_ready else None,
            lambda: self.cluster.scale_events.running is not None, self.metrics.server.registry,
        )
        self.cluster.scale_events.on_finished = self._on_scale_finished
        self.metrics.register_health(lambda: self.healer.is_serving, lambda: self.healer.faults,
                                     lambda: (self.engine.num_recovered, self.engine.num_tokens_recomputed))
        self.autoscale.start()
        self.healer.start()

    def _on_scale_finished(self, event: ScaleEvent) -> None:
        self.metrics.on_scale_finished(event)
        self.autoscale.on_scale_finished(event)

    def _active_dp(self) -> float:
        active = self.cluster.active
        return float(active.dp) if active is not None and self.cluster.is_ready else 0.0

    def __serve_build_asgi_app__(self) -> FastAPI:
        app = build_app(self.cluster, self.engine, self.metrics, self.scales, self.autoscale, self.drainer,
                        self.healer)
        add_adapter_routes(app, self.cluster.adapters, lambda: self.model_config, self.cluster.config.model_name)
        return app

    def process(self) -> tuple[str, int]:
        """(node address, pid) of this replica (the driver watches it while it drains)."""
        return ray.util.get_node_ip_address(), os.getpid()

    async def drain(self, timeout_s: float | None = None) -> dict:
        """Stop admitting `/v1/*` (503) and the autoscaler, wait for requests in flight (SIGTERM)."""
        self.autoscale.policy.pause("draining")
        return await self.drainer.drain(self.cluster.config.shutdown_timeout_s if timeout_s is None else timeout_s)

    async def shutdown_cluster(self) -> None:
        """Retire the instance and free the HMM now (before `serve.shutdown()` kills this replica)."""
        await self.autoscale.stop()
        await asyncio.to_thread(self.healer.stop)  # no repair may start under the shutdown
        # NOTE: a running scale owns a second instance and the HMM's pending plan: let it end first.
        await asyncio.to_thread(self.scales.join)
        await asyncio.to_thread(self.cluster.shutdown)

    def __del__(self) -> None:
        # Serve calls this on graceful replica shutdown; a no-op after `shutdown_cluster`.
        healer: Any = getattr(self, "healer", None)
        if healer is not None:
            healer.stop()
        cluster: Any = getattr(self, "cluster", None)
        if cluster is not None:
            cluster.shutdown()
