"""The elastic server's HTTP ingress: a Ray Serve deployment serving a FastAPI app.

It holds the clients' connections and nothing that decides what serves: it routes each request
to a rank of the instance the coordinator published last (`coordinator.routing_follower`
keeps the router on the coordinator's `RoutingState`), streams the rank's outputs back, and
forwards the admin API to the coordinator (`coordinator.controller`, another deployment).
So the coordinator may die and come back (Serve restarts it) without failing a stream: the
requests wait here and continue on its new instance from what their clients received.

Routes: the OpenAI API of `elasticmoe.entrypoints.openai` (the same handlers and route wiring
as the single-process server, over a `RouterEngineClient`), `/health` (200 "ok", or
"degraded" with the faults while something is repaired or the coordinator is unreachable;
503 once repairs keep failing), `/ready` (503 while no instance serves or while draining),
`/metrics` (this ingress's, then the coordinator's), the admin API of
`coordinator.admin_routes`, the adapter routes, and `POST /admin/drain`. API keys, size
limits and the drain are middleware shared with the single-process server (`install_guards`).

The FastAPI app is built per replica (`__serve_build_asgi_app__`, Serve's late-bound
`@serve.ingress()`), so its routes close over the replica's own objects. Given an
`HttpBinding` (`elasticmoe serve`), the replica serves it on its own HTTP server
(`coordinator.ingress_http`) and Serve runs no proxy; without one (a Serve config deployed by
KubeRay) Serve's proxy reaches the same app.
NOTE: one replica: a scrape, a drain and the SLO counters see all traffic through it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from typing import Any

import ray
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from ray import serve

from coordinator.admin_routes import add_admin_routes
from coordinator.config import CoordinatorConfig
from coordinator.coordinator_client import CoordinatorClient, RemoteAdapterHost
from coordinator.engine_client import QueueFull, RouterEngineClient
from coordinator.ingress_http import DirectHttp, HttpBinding
from coordinator.ingress_metrics import IngressMetrics
from coordinator.observations import ObservationBuffer
from coordinator.router import Router
from coordinator.routing_follower import RoutingFollower
from elasticmoe.entrypoints.openai.adapters_api import add_adapter_routes
from elasticmoe.entrypoints.openai.drain import Drainer, add_drain_route
from elasticmoe.entrypoints.openai.errors import OpenAIError, error_json, install_exception_handlers
from elasticmoe.entrypoints.openai.routes import add_openai_routes, install_guards
from elasticmoe.entrypoints.openai.serving import OpenAIServing, RequestStats, ServingObserver
from elasticmoe.errors import describe_error
from elasticmoe.tokenizer import Tokenizer
from elasticmoe.utils.gc_heap import freeze_startup_heap
from hmm.lifeline import in_ray_actor, watch_parent

logger = logging.getLogger(__name__)

REPORT_INTERVAL_S = 0.25  # how often what was seen of requests goes to the coordinator's SLO estimator
METRICS_TIMEOUT_S = 5.0

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
        "/admin/nodes",
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


def _profile_kinds(path: str | None) -> dict[str, Any]:
    """The latency model per adapter kind of the server's profile (none without one)."""
    if path is None:
        return {}
    from elasticmoe.adapter_policy.profile import load_profile

    return dict(load_profile(path).kinds)


class _Observers:
    """Finished requests go to the metrics and to the coordinator's SLO estimator."""

    def __init__(self, *observers: ServingObserver) -> None:
        self.observers = observers

    def on_request_finished(self, stats: RequestStats) -> None:
        for observer in self.observers:
            observer.on_request_finished(stats)


def build_ingress_app(
    config: CoordinatorConfig,
    engine: RouterEngineClient,
    coordinator: CoordinatorClient,
    follower: RoutingFollower,
    metrics: IngressMetrics,
    observations: ObservationBuffer,
    drainer: Drainer,
) -> FastAPI:
    app = FastAPI(title="ElasticMoE", summary="OpenAI-compatible elastic MoE serving (ingress)")
    router = engine.router
    serving = OpenAIServing(engine, config.model_name, observer=_Observers(metrics, observations),
                            reasoning_parser=config.reasoning_parser)
    install_exception_handlers(app)
    app.add_exception_handler(QueueFull, _handle_queue_full)
    install_guards(app, config.access, drainer, metrics.server, ENDPOINTS)
    add_openai_routes(app, serving)
    add_drain_route(app, drainer, config.shutdown_timeout_s)
    add_admin_routes(app, coordinator, engine, follower, drainer)
    add_adapter_routes(app, RemoteAdapterHost(coordinator, engine.adapter_names), config.model_name)

    @app.get("/health")
    async def health() -> Response:
        """Liveness: 200 "ok", or "degraded" with the faults while what failed is being repaired
        (or the coordinator is unreachable); 503 once repairs keep failing (a restart is needed)."""
        state = router.state
        faults = state.fault_dict() if state is not None else {"coordinator": "no state yet"}
        if state is not None and state.has_given_up:
            return JSONResponse({"status": "unhealthy", "faults": faults}, status_code=503)
        if faults:
            return JSONResponse({"status": "degraded", "faults": faults})
        return JSONResponse({"status": "ok"})

    @app.get("/ready")
    async def ready() -> Response:
        if drainer.is_draining:
            return error_json(OpenAIError("The server is draining.", status_code=503))
        state = router.state
        if state is None or not state.is_serving:
            return error_json(OpenAIError("No instance is serving.", status_code=503))
        return JSONResponse({"status": "ready"})

    @app.get("/metrics")
    async def show_metrics() -> Response:
        body = metrics.render()
        try:  # NOTE: a coordinator that cannot answer leaves the scrape with this ingress's part only
            body += await coordinator.call("metrics_text", timeout_s=METRICS_TIMEOUT_S)
        except Exception as exc:  # noqa: BLE001
            logger.info("coordinator metrics unavailable: %s", describe_error(exc))
        return Response(body, media_type=CONTENT_TYPE_LATEST)

    return app


# NOTE: an ingress stopped by Serve finishes its requests in flight (up to the default 20 s) and
# looks every 0.2 s whether they are done (Serve's default: every 2 s, at least once).
@serve.deployment(name="ingress", num_replicas=1, health_check_period_s=1.0, health_check_timeout_s=15.0,
                  graceful_shutdown_wait_loop_s=0.2, ray_actor_options={"num_cpus": 0})
@serve.ingress()
class Ingress:
    """One replica: follows the coordinator, serves HTTP."""

    async def __init__(  # type: ignore[misc]
        self, config: CoordinatorConfig, coordinator: Any, http: HttpBinding | None = None
    ) -> None:
        if in_ray_actor():  # exit with the node's raylet (see hmm.lifeline)
            watch_parent()
        self.config = config
        self.coordinator = CoordinatorClient(coordinator)
        tokenizer = await asyncio.to_thread(Tokenizer, config.model_dir)
        self.observations = ObservationBuffer()
        router: Router[Any] = Router(max_hold_s=config.max_hold_s, assign=config.request_assigning,
                                     kinds=await asyncio.to_thread(_profile_kinds, config.profile),
                                     prefix_affinity=config.enable_prefix_caching and config.prefix_routing,
                                     lora_slots_per_rank=config.rank_local_lora_slots)
        self.engine = RouterEngineClient(router, tokenizer, config.max_queued,
                                         on_rank_failure=lambda rank: self.coordinator.notify_rank_failure(),
                                         make_resident=self._make_resident, swap_unwanted=self.coordinator.swap_unwanted)
        self.engine.on_arrival, self.engine.on_failed = self.observations.on_arrival, self.observations.on_failed
        self.engine.on_adapter = self.observations.on_adapter
        self.follower = RoutingFollower(self.coordinator.routing, router)
        self.drainer = Drainer()
        self.metrics = IngressMetrics(
            lambda: float(self.engine.num_queued),
            lambda: router.state is not None and router.state.is_serving,
            lambda: router.state.fault_dict() if router.state is not None else {},
            lambda: (self.engine.num_recovered, self.engine.num_tokens_recomputed),
        )
        self.follower.start()
        # Serve routes to this replica once its constructor returns: only when something serves
        # (and its own HTTP server listens from then on too).
        await self.follower.wait_serving()
        self._reporter = asyncio.create_task(self._report(), name="observation-reporter")
        self.fastapi_app = build_ingress_app(config, self.engine, self.coordinator, self.follower, self.metrics,
                                             self.observations, self.drainer)
        self.http = None if http is None else await DirectHttp.start(self.fastapi_app, http, config.access)
        freeze_startup_heap("ingress")  # the tokenizer, router and app live as long as the replica

    def __del__(self) -> None:
        """Serve stops the replica: stop listening (the driver drained it first). NOTE: not async:
        Python calls it again when the object is collected, and would warn of a coroutine never awaited."""
        http = getattr(self, "http", None)
        if http is not None:
            http.close()

    async def _make_resident(self, adapter: str) -> None:
        await self.coordinator.call("make_resident", adapter, timeout_s=self.engine.swap_wait_s)

    async def _report(self) -> None:
        while True:
            await asyncio.sleep(REPORT_INTERVAL_S)
            batch = self.observations.take()
            if batch is None:
                continue
            with contextlib.suppress(Exception):  # dropped: a restarting coordinator starts a fresh estimate
                await self.coordinator.call("observe", batch, timeout_s=5.0)

    def __serve_build_asgi_app__(self) -> FastAPI:
        return self.fastapi_app

    def process(self) -> tuple[str, int]:
        """(node address, pid) of this replica (the driver watches it while it drains)."""
        return ray.util.get_node_ip_address(), os.getpid()

    async def drain(self, timeout_s: float | None = None) -> dict:
        """Stop admitting `/v1/*` (503) and the autoscaler, wait for requests in flight (SIGTERM)."""
        with contextlib.suppress(Exception):  # the drain goes on without the coordinator
            await self.coordinator.call("pause_autoscaler", "draining", timeout_s=5.0)
        return await self.drainer.drain(self.config.shutdown_timeout_s if timeout_s is None else timeout_s)
