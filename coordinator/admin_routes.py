"""The elastic server's admin API, served by the ingress and answered by the coordinator.

    GET  /admin/status              what runs where (the coordinator's view, plus this ingress's requests)
    GET  /admin/devices             registered devices and the Ray nodes offering devices
    POST /admin/scale {"dp", "strategy"}   202 with the event id; the scale runs in the background
    GET  /admin/scale/{event_id}    one scale event
    GET|POST /admin/autoscaler      the SLO-driven autoscaler (a manual scale pauses it)
    GET  /admin/nodes               nodes offering devices, with their state
    POST /admin/nodes/{node_id}/drain   202: move the model off the node, then free its devices
    GET  /admin/nodes/{node_id}     one node (a drained one says `removable`)

The adapter routes are `elasticmoe.entrypoints.openai.adapters_api`'s over a
`RemoteAdapterHost`; `POST /admin/drain` is the drain route of the ingress itself.
"""

from __future__ import annotations

import os
from typing import Any

from fastapi import FastAPI
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, Field

from coordinator.coordinator_client import CoordinatorClient
from coordinator.engine_client import RouterEngineClient
from coordinator.routing_follower import RoutingFollower
from coordinator.scale_runner import ScaleRequest
from elasticmoe.entrypoints.openai.drain import Drainer


class AutoscalerUpdate(BaseModel):
    # An admin request refuses fields it does not know: a typo, or a setting sent here that only a
    # restart changes, must not look applied.
    model_config = ConfigDict(extra="forbid")

    enabled: bool = Field(strict=True, description="true: (re)start deciding; false: stop.")


def add_admin_routes(
    app: FastAPI,
    coordinator: CoordinatorClient,
    engine: RouterEngineClient,
    follower: RoutingFollower,
    drainer: Drainer,
) -> None:
    router = engine.router

    @app.get("/admin/status")
    async def admin_status() -> Response:
        status: dict[str, Any] = await coordinator.call("status")
        state = router.state
        status["requests"] = {"queued": engine.num_queued, "max_queued": engine.max_queued,
                              "held_at_gate": router.num_held, "rejected": engine.num_rejected,
                              "recovered": engine.num_recovered, "tokens_recomputed": engine.num_tokens_recomputed,
                              "draining": drainer.is_draining, "swap_waits": engine.num_swap_waits,
                              "assigning_s": router.assign_s}
        status["ingress"] = {"pid": os.getpid(), "coordinator_connected": follower.is_connected,
                             "routing_version": None if state is None else state.version,
                             "accepting": router.is_accepting, "in_flight": router.loads()}
        return JSONResponse(status)

    @app.get("/admin/devices")
    async def admin_devices() -> Response:
        """The registered devices (node, state, memory) and the Ray nodes offering devices now."""
        return JSONResponse(await coordinator.call("devices"))

    @app.post("/admin/scale", status_code=202)
    async def start_scale(request: ScaleRequest) -> Response:
        """A manual scale; it pauses the autoscaler (an operator's decision wins until resumed)."""
        return JSONResponse(await coordinator.call("start_scale", request.dp, request.strategy), status_code=202)

    @app.get("/admin/scale/{event_id}")
    async def show_scale(event_id: str) -> Response:
        return JSONResponse(await coordinator.call("scale_event", event_id))

    @app.get("/admin/nodes")
    async def show_nodes() -> Response:
        return JSONResponse(await coordinator.call("nodes"))

    @app.get("/admin/nodes/{node_id}")
    async def show_node(node_id: str) -> Response:
        return JSONResponse(await coordinator.call("node", node_id))

    @app.post("/admin/nodes/{node_id}/drain", status_code=202)
    async def drain_node(node_id: str) -> Response:
        """Move the model off the node (zero-downtime switchover), then unregister and free its
        devices; poll `GET /admin/nodes/{node_id}` until `removable`."""
        return JSONResponse(await coordinator.call("drain_node", node_id), status_code=202)

    @app.get("/admin/autoscaler")
    async def show_autoscaler() -> Response:
        return JSONResponse(await coordinator.call("autoscaler"))

    @app.post("/admin/autoscaler")
    async def update_autoscaler(update: AutoscalerUpdate) -> Response:
        return JSONResponse(await coordinator.call("set_autoscaler", update.enabled, drainer.is_draining))
