"""The coordinator: the Serve deployment that owns the cluster (one replica, no HTTP).

It starts the HMM and the first instance in its constructor and owns everything that changes
what serves: scales (`coordinator.scaler`), repairs (`coordinator.healer`), the autoscaler,
adapters. The ingress (`coordinator.ingress`) holds the clients' connections and talks to it
through a `DeploymentHandle`: it follows the routing state (`routing`, a long poll), reports
what it saw of requests (`observe`) and rank failures (`notify_rank_failure`), and forwards the
admin API. Nothing a client waits for streams through here, so this process may die (Serve
restarts it; Ray ends the actors it owned and the new one frees their memory as it starts):
the ingress holds its requests meanwhile and continues them on the new instance.

Errors a client should see leave as `OpenAIError`s (they keep their status across processes).
NOTE: run exactly one replica: it owns the HMM and the instances.
"""

from __future__ import annotations

import asyncio
import os
from typing import Any

import ray
from ray import serve

from coordinator import cluster_status
from coordinator.autoscale_loop import AutoscaleLoop
from coordinator.autoscaler import Autoscaler
from coordinator.config import CoordinatorConfig
from coordinator.observations import Observations
from coordinator.routing_state import RoutingState
from coordinator.scale_events import ScaleEvent
from coordinator.scale_runner import ScaleRunner
from coordinator.slo import SloTracker
from coordinator.strategies import DEFAULT_STRATEGY
from elasticmoe.entrypoints.openai.errors import OpenAIError
from hmm.lifeline import in_ray_actor, watch_parent


# NOTE: a short graceful shutdown: what may be in flight at the end are the ingress's long polls
# (cut short safely: the follower asks again) and admin reads; the cluster is shut down before.
# Serve checks for ongoing requests every `graceful_shutdown_wait_loop_s` (default 2 s, each
# replica waits at least one): 0.2 s stops an idle replica at once.
@serve.deployment(name="coordinator", num_replicas=1, max_ongoing_requests=256, graceful_shutdown_timeout_s=1.0,
                  graceful_shutdown_wait_loop_s=0.2, health_check_period_s=1.0, health_check_timeout_s=15.0,
                  ray_actor_options={"num_cpus": 0})
class Coordinator:
    """One replica: starts the cluster in its constructor, and frees it on shutdown."""

    async def __init__(self, config: CoordinatorConfig) -> None:  # type: ignore[misc]
        if in_ray_actor():  # exit with the node's raylet (see hmm.lifeline)
            watch_parent()
        # NOTE: imported here, not with the module: they hold the HMM, the instances and the
        # adapters (and import PyTorch), and the process that deploys the application
        # (`elasticmoe serve`, `coordinator.launch`) imports this class but needs none of them.
        from coordinator.adapters import LOCK_WAIT_S
        from coordinator.cluster import ClusterManager
        from coordinator.healer import Healer
        from coordinator.metrics import ClusterMetrics
        from coordinator.node_drain import NodeDrainer
        from coordinator.scaler import Scaler

        self.config = config
        self._lock_wait_s = LOCK_WAIT_S
        self.cluster = ClusterManager(config)
        await asyncio.to_thread(self.cluster.start)
        scaler = Scaler(self.cluster)
        self.healer = Healer(self.cluster, scaler)
        for name, path in config.esft_adapters:  # --esft-adapter: a bad one fails the start
            await self.cluster.adapters.load_esft(name, path)
        for name, path in config.lora_adapters:  # --lora-adapter
            await self.cluster.adapters.load_lora(name, path)
        self.scales = ScaleRunner(scaler)
        self.node_drainer = NodeDrainer(self.cluster, scaler)
        self.metrics = ClusterMetrics(self._active_dp)
        tracker = SloTracker(config.autoscale.targets, config.autoscale.window_s)
        self.autoscale = AutoscaleLoop(
            Autoscaler(config.autoscale, config.device_limit), tracker, self.scales.start,
            lambda: self.cluster.active.dp if self.cluster.active is not None and self.cluster.is_ready else None,
            lambda: self.cluster.scale_events.running is not None, self.metrics.registry,
        )
        self.cluster.scale_events.on_finished = self._on_scale_finished
        self.autoscale.start()
        self.healer.start()

    def _on_scale_finished(self, event: ScaleEvent) -> None:
        self.metrics.on_scale_finished(event)
        self.autoscale.on_scale_finished(event)

    def _active_dp(self) -> float:
        active = self.cluster.active
        return float(active.dp) if active is not None and self.cluster.is_ready else 0.0

    # ---- the ingress's feed --------------------------------------------------------------

    async def routing(self, after: tuple[str, int] | None, timeout_s: float) -> RoutingState:
        """The routing state as soon as it differs from the one keyed `after` (a long poll)."""
        key = None if after is None else (str(after[0]), int(after[1]))  # a list once it crossed processes
        return await self.cluster.feed.next(key, timeout_s)

    async def notify_rank_failure(self) -> None:
        """A stream saw its rank fail: look now instead of at the next probe."""
        self.healer.notify()

    async def observe(self, batch: Observations) -> None:
        """What the ingress saw of requests since its last report (the SLO estimator's input, and
        the adapter swaps' usage)."""
        batch.apply(self.autoscale.tracker)
        self.cluster.adapters.residency.note_used(dict(batch.adapters_used))

    # ---- admin ---------------------------------------------------------------------------

    async def status(self) -> dict[str, Any]:
        status = await asyncio.to_thread(cluster_status.status, self.cluster)
        status["health"] = {"ready": self.cluster.routing.is_serving, **self.healer.status()}
        status["scale_events"] = [e.to_dict() for e in self.cluster.scale_events.all()[-20:]]  # the latest 20
        status["slo"] = self.autoscale.tracker.snapshot().to_dict()
        status["autoscaler"] = self.autoscale.policy.status()
        if self.config.offloads_experts:
            options = self.config.engine_options()
            status["offload"] = {"policy": options.offload_policy, "prefetch_distance": options.offload_prefetch_distance,
                                 "expert_tier": options.expert_tier, "expert_page_cache": options.expert_page_cache}
            status["expert_cache"] = await self._expert_cache_status()
        return status

    async def _expert_cache_status(self) -> list[dict[str, Any]] | None:
        """Each active rank's expert cache (offloading); None when the ranks did not answer in time."""
        try:
            ranks = await self.cluster.rank_stats(timeout_s=2.0)
        except Exception:  # noqa: BLE001 - a status page answers without this part rather than fail
            return None
        return [{"rank": s.rank, "capacity_experts": s.expert_cache_capacity,
                 "resident_experts": s.expert_cache_resident, "lookups": s.num_expert_lookups,
                 "hits": s.num_expert_hits,
                 "hit_rate": round(s.num_expert_hits / s.num_expert_lookups, 4) if s.num_expert_lookups else None,
                 "on_demand_loads": s.num_expert_loads_on_demand, "prefetches": s.num_expert_loads_prefetch,
                 "bytes_loaded_host": s.expert_bytes_loaded_host, "bytes_loaded_disk": s.expert_bytes_loaded_disk}
                for s in ranks]

    async def devices(self) -> dict[str, Any]:
        """The registered devices (node, state, memory) and the Ray nodes offering devices now."""
        return await asyncio.to_thread(cluster_status.devices_report, self.cluster)

    async def start_scale(self, dp: int, strategy: str = DEFAULT_STRATEGY) -> dict[str, Any]:
        """A manual scale (raises `OpenAIError`); it pauses the autoscaler (an operator's decision
        wins until resumed)."""
        event_id = await asyncio.to_thread(self.scales.start, dp, strategy, self._lock_wait_s)
        policy = self.autoscale.policy
        if policy.enabled:
            policy.pause(f"manual scale {event_id}; resume with POST /admin/autoscaler")
        return {"event_id": event_id, "autoscaler_paused": policy.enabled}

    async def scale_event(self, event_id: str) -> dict[str, Any]:
        event = self.cluster.scale_events.get(event_id)
        if event is None:
            raise OpenAIError(f"No scale event {event_id[:64]!r}.", status_code=404, param="event_id")
        return event.to_dict()

    async def autoscaler(self) -> dict[str, Any]:
        return {**self.autoscale.policy.status(), "slo": self.autoscale.tracker.snapshot().to_dict()}

    async def set_autoscaler(self, enabled: bool, is_draining: bool) -> dict[str, Any]:
        policy = self.autoscale.policy
        if enabled:
            if is_draining:
                raise OpenAIError("The server is draining; the autoscaler stays off.", status_code=409,
                                  param="enabled")
            policy.resume()
        else:
            policy.enabled = False
        return policy.status()

    async def nodes(self) -> dict[str, Any]:
        """Every node offering devices now, with its state, and the nodes drained, given back or lost."""
        return await asyncio.to_thread(cluster_status.nodes_report, self.cluster)

    async def node(self, node_id: str) -> dict[str, Any]:
        return await asyncio.to_thread(self.node_drainer.describe, node_id)

    async def drain_node(self, node_id: str) -> dict[str, Any]:
        """Start moving the model off `node_id` and giving its devices back (`coordinator.node_drain`)."""
        return await asyncio.to_thread(self.node_drainer.start, node_id)

    async def pause_autoscaler(self, reason: str) -> None:
        self.autoscale.policy.pause(reason)

    async def metrics_text(self) -> bytes:
        """The cluster's metrics, refreshed now. One snapshot that fails or times out leaves its
        gauges stale (a stale gauge beats a failed scrape). NOTE: device workers answer after a
        scale's copies."""
        stats, devices = await asyncio.gather(
            self.cluster.rank_stats(), self.cluster.device_memory(), return_exceptions=True
        )
        if not isinstance(stats, BaseException):
            self.metrics.refresh(stats)
        if not isinstance(devices, BaseException):
            self.metrics.refresh_devices(devices)
        self.metrics.refresh_adapters(self.cluster.adapter_slots(), self.cluster.adapters.swap_stats())
        return self.metrics.render()

    # ---- adapters (`coordinator_client.RemoteAdapterHost` calls these; the files are opened here) ----

    async def load_esft(self, name: str, path: str, usage_probability: float | None = None) -> dict[str, Any]:
        return await self.cluster.adapters.load_esft(name, path, usage_probability)

    async def load_lora(self, name: str, path: str, usage_probability: float | None = None) -> dict[str, Any]:
        return await self.cluster.adapters.load_lora(name, path, usage_probability)

    async def load_router(self, name: str, path: str, usage_probability: float | None = None) -> dict[str, Any]:
        return await self.cluster.adapters.load_router(name, path, usage_probability)

    async def unload_adapter(self, name: str) -> bool:
        return await self.cluster.adapters.unload(name)

    async def make_resident(self, name: str) -> None:
        """Swap ESFT adapter `name` into a slot if it is not in one (`coordinator.esft_residency`)."""
        await self.cluster.adapters.residency.make_resident(name)

    def swap_unwanted(self, name: str) -> None:
        """An ingress's waiters for ESFT adapter `name` are all gone (`EsftResidency.unwanted`)."""
        self.cluster.adapters.residency.unwanted(name)

    async def describe_adapters(self) -> list[dict[str, Any]]:
        return await self.cluster.adapters.describe()

    # ---- lifetime ------------------------------------------------------------------------

    def process(self) -> tuple[str, int]:
        """(node address, pid) of this replica (the driver watches it while it shuts down)."""
        return ray.util.get_node_ip_address(), os.getpid()

    async def shutdown_cluster(self) -> None:
        """Retire the instance and free the HMM now (before `serve.shutdown()` kills this replica)."""
        await self.autoscale.stop()
        await asyncio.to_thread(self.healer.stop)  # no repair may start under the shutdown
        # NOTE: a running scale owns a second instance and the HMM's pending plan: let it end first.
        await asyncio.to_thread(self.scales.join)
        await asyncio.to_thread(self.node_drainer.join)
        await asyncio.to_thread(self.cluster.shutdown)

    def __del__(self) -> None:
        # Serve calls this on graceful replica shutdown; a no-op after `shutdown_cluster`.
        healer: Any = getattr(self, "healer", None)
        if healer is not None:
            healer.stop()
        cluster: Any = getattr(self, "cluster", None)
        if cluster is not None:
            cluster.shutdown()
