"""Prometheus metrics of the coordinator: the cluster's gauges and counters.

The engines' running/waiting requests and KV usage, the active configuration, scale
events (count by strategy and outcome; latency, downtime and peak memory of each),
devices and their HMM memory, adapter slots and LoRA slot hits, in one registry (the SLO
and autoscaler metrics of `coordinator.autoscale_loop` register there too). The ingress
serves them on `/metrics` after its own (`coordinator.ingress_metrics`: HTTP, latencies,
queue, readiness). docs/operations.md lists every metric.

Rank counters live in the rank actors and device memory in the HMM workers;
`refresh(stats)` / `refresh_devices(...)` / `refresh_adapters(...)` copy a
snapshot in, and the gauges read the snapshot, so rendering never blocks on Ray.
The ranks' LoRA counters restart with every new instance; the coordinator adds
their growth per engine (`RankStats.engine_id`) to counters of its own, which
only grow over the server's life.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from coordinator.memory_stats import AdapterSlotStats, DeviceMemoryStats
from coordinator.scale_events import ScaleEvent, ScaleState
from coordinator.strategies import DEFAULT_STRATEGY
from elasticmoe.entrypoints.openai.metrics import register_engine_queue
from imm.rank_stats import RankStats

_SCALE_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
# RankStats field -> (name, help, unit, labels): counters that only grow per engine, summed over
# ranks and instances. The expert-cache families carry the single server's names and labels.
_LOADS_HELP = "Experts copied into the ranks' expert caches, by why."
_BYTES_HELP = "Bytes copied into the ranks' expert caches, by the tier they came from."
_ENGINE_COUNTERS: dict[str, tuple[str, str, float, dict[str, str]]] = {
    "num_steps": ("elasticmoe_engine_steps", "Steps the ranks' engines ran (each one batch of tokens; an "
                  "engine that stops stepping once its requests ended or were aborted adds none).", 1.0, {}),
    "num_lora_swaps_in": ("elasticmoe_lora_swaps_in", "LoRA adapters copied into a rank's slot.", 1.0, {}),
    "num_lora_preloads": ("elasticmoe_lora_preloads", "LoRA adapters copied into a rank's slot ahead of any "
                          "request, by usage probability (also in elasticmoe_lora_swaps_in).", 1.0, {}),
    "num_lora_evictions": ("elasticmoe_lora_evictions", "LoRA adapters evicted from a rank's slot.", 1.0, {}),
    "num_lora_hits": ("elasticmoe_lora_hits", "LoRA requests admitted with their adapter already in a slot.", 1.0,
                      {}),
    "num_lora_misses": ("elasticmoe_lora_misses", "LoRA requests that waited for their adapter's swap-in.", 1.0, {}),
    "lora_swap_us": ("elasticmoe_lora_swap_seconds", "Time the ranks spent copying LoRA factors into slots.", 1e-6,
                     {}),
    "arrange_us": ("elasticmoe_request_arranging_seconds", "Time the ranks' schedulers spent arranging their "
                   "windows (--request-arranging).", 1e-6, {}),
    "num_expert_lookups": ("elasticmoe_expert_cache_lookups", "Expert lookups by the ranks' forwards (one per "
                           "iteration, layer and routed expert).", 1.0, {}),
    "num_expert_hits": ("elasticmoe_expert_cache_hits", "Expert lookups that found the expert resident.", 1.0, {}),
    "num_expert_loads_on_demand": ("elasticmoe_expert_loads", _LOADS_HELP, 1.0, {"kind": "on_demand"}),
    "num_expert_loads_prefetch": ("elasticmoe_expert_loads", _LOADS_HELP, 1.0, {"kind": "prefetch"}),
    "expert_bytes_loaded_host": ("elasticmoe_expert_bytes_loaded", _BYTES_HELP, 1.0, {"tier": "host"}),
    "expert_bytes_loaded_disk": ("elasticmoe_expert_bytes_loaded", _BYTES_HELP, 1.0, {"tier": "disk"}),
    "num_prefix_cache_queries": ("elasticmoe_prefix_cache_queries", "Prompt tokens of admitted requests looked "
                                 "up in the ranks' prefix caches.", 1.0, {}),
    "num_prefix_cache_hits": ("elasticmoe_prefix_cache_hits", "Prompt tokens found in the ranks' prefix caches "
                              "(not computed again).", 1.0, {}),
}
_MAX_ENGINES = 256  # engines whose last counters are remembered (a few per scale event)


class ClusterMetrics:
    """The coordinator's registry; `refresh*` copy snapshots in, `render` exports them."""

    def __init__(self, active_dp: Callable[[], float]) -> None:
        self._stats: list[RankStats] = []
        self.registry = registry = CollectorRegistry()
        register_engine_queue(registry, lambda: sum(s.num_running for s in self._stats),
                              lambda: sum(s.num_waiting for s in self._stats))
        self.kv_usage = Gauge(
            "elasticmoe_kv_cache_usage_ratio",
            "Fraction of KV blocks in use, per DP rank of the active instance.",
            ["rank"],
            registry=registry,
        )
        Gauge(
            "elasticmoe_active_dp", "Data-parallel size (= expert-parallel size) of the active instance.",
            registry=registry,
        ).set_function(active_dp)

        self.scale_events = Counter(
            "elasticmoe_scale_events",
            "Finished scale events by strategy and outcome (succeeded, rolled_back, failed).",
            ["strategy", "outcome"],
            registry=registry,
        )
        self.scale_latency = Histogram(
            "elasticmoe_scale_latency_seconds",
            "Scale request accepted -> new instance active.",
            ["strategy"],
            buckets=_SCALE_BUCKETS,
            registry=registry,
        )
        self.scale_downtime = Histogram(
            "elasticmoe_scale_downtime_seconds",
            "Longest interval of a scale in which no instance accepted and progressed requests.",
            ["strategy"],
            buckets=(0.0, *_SCALE_BUCKETS),
            registry=registry,
        )
        self.scale_peak_memory = Gauge(
            "elasticmoe_scale_last_peak_memory_bytes",
            "Peak device memory (summed over devices) during the last finished scale event.",
            ["strategy"],
            registry=registry,
        )
        # The default strategy's series exist (at 0) from the start, so `increase()` sees its first event.
        for outcome in (ScaleState.SUCCEEDED, ScaleState.ROLLED_BACK, ScaleState.FAILED):
            self.scale_events.labels(DEFAULT_STRATEGY, outcome.value)
        self.scale_latency.labels(DEFAULT_STRATEGY)
        self.scale_downtime.labels(DEFAULT_STRATEGY)
        self.last_scale = Gauge(
            "elasticmoe_scale_last_finished_timestamp_seconds",
            "Unix time at which the last scale event finished (Grafana annotations).",
            registry=registry,
        )

        self.num_devices = Gauge(
            "elasticmoe_num_devices", "Devices registered with the HMM (active or not).", registry=registry
        )
        self.device_capacity = Gauge(
            "elasticmoe_device_memory_capacity_bytes",
            "Memory budget of each device.",
            ["device"],
            registry=registry,
        )
        self.device_used = Gauge(
            "elasticmoe_device_memory_used_bytes",
            "HMM memory in use on each device (all of it: a running scale's staged tensors too).",
            ["device"],
            registry=registry,
        )
        self.device_peak = Gauge(
            "elasticmoe_device_memory_peak_bytes",
            "Peak HMM memory of each device since the last scale event started.",
            ["device"],
            registry=registry,
        )
        self.device_layout = Gauge(
            "elasticmoe_device_memory_layout_bytes",
            "HMM memory of the committed layout on each device by kind (weights, kv, adapters; with offloading "
            "expert_cache, and host_experts: the host tier, not charged to the device).",
            ["device", "kind"],
            registry=registry,
        )

        self.adapters_loaded = Gauge(
            "elasticmoe_adapters_loaded",
            "Adapters registered by kind (esft, lora).",
            ["kind"],
            registry=registry,
        )
        self.adapter_slots = Gauge(
            "elasticmoe_adapter_slots",
            "Adapter slots by kind (esft: of the cluster; lora: of each rank).",
            ["kind"],
            registry=registry,
        )
        self.esft_resident = Gauge(
            "elasticmoe_esft_adapters_resident",
            "ESFT adapters in a slot (the others are registered on disk and swapped in on demand).",
            registry=registry,
        )
        self.esft_swaps = Gauge(
            "elasticmoe_esft_swaps",
            "ESFT adapter swaps since the coordinator started, by direction (in, out).",
            ["direction"],
            registry=registry,
        )
        self.lora_slots_used = Gauge(
            "elasticmoe_lora_slots_used",
            "LoRA slots holding an adapter, per DP rank of the active instance.",
            ["rank"],
            registry=registry,
        )
        self.lora_slot_bytes = Gauge(
            "elasticmoe_lora_slot_bytes",
            "Bytes of one LoRA slot (its target modules' factors), per DP rank of the active instance: the "
            "rank's own memory, outside the HMM's device budget.",
            ["rank"],
            registry=registry,
        )
        self.expert_cache_resident = Gauge(
            "elasticmoe_expert_cache_resident_experts",
            "Experts resident in the expert cache, per DP rank of the active instance (offloading).",
            ["rank"],
            registry=registry,
        )
        self.expert_cache_capacity = Gauge(
            "elasticmoe_expert_cache_capacity_experts",
            "Expert rows the expert cache's budget buys, per DP rank of the active instance (offloading).",
            ["rank"],
            registry=registry,
        )
        families: dict[str, Counter] = {}
        for name, doc, _, labels in _ENGINE_COUNTERS.values():
            if name not in families:
                families[name] = Counter(name, doc, sorted(labels), registry=registry)
        self.engine_counters = {
            field: families[name].labels(**labels) if labels else families[name]
            for field, (name, _, _, labels) in _ENGINE_COUNTERS.items()
        }
        self._seen_by_engine: dict[str, dict[str, int]] = {}

    def on_scale_finished(self, event: ScaleEvent) -> None:
        self.scale_events.labels(event.strategy, event.state.value).inc()
        self.last_scale.set(event.finished_at or 0.0)
        if event.state.value != "succeeded":
            return
        if event.scale_latency_s is not None:
            self.scale_latency.labels(event.strategy).observe(event.scale_latency_s)
        if event.downtime_s is not None:
            self.scale_downtime.labels(event.strategy).observe(event.downtime_s)
        if event.peak_memory_bytes is not None:
            self.scale_peak_memory.labels(event.strategy).set(event.peak_memory_bytes)

    def refresh(self, stats: Sequence[RankStats]) -> None:
        """Take a fresh snapshot of the active instance's rank counters."""
        self._stats = list(stats)
        for gauge in (self.kv_usage, self.lora_slots_used, self.lora_slot_bytes, self.expert_cache_resident,
                      self.expert_cache_capacity):
            gauge.clear()
        for s in self._stats:
            self.kv_usage.labels(str(s.rank)).set(s.kv_usage)
            self.lora_slots_used.labels(str(s.rank)).set(s.num_lora_resident)
            if s.num_lora_slots:
                self.lora_slot_bytes.labels(str(s.rank)).set(s.lora_slot_bytes)
            if s.expert_cache_capacity:
                self.expert_cache_resident.labels(str(s.rank)).set(s.expert_cache_resident)
                self.expert_cache_capacity.labels(str(s.rank)).set(s.expert_cache_capacity)
            self._count(s)

    def _count(self, stats: RankStats) -> None:
        """Add the growth of one engine's counters since the highest values seen."""
        # NOTE: a counter lower than seen is a stale snapshot (two scrapes raced), never a
        # restart: an engine's counters only grow.
        seen = self._seen_by_engine.pop(stats.engine_id, {})
        for field, counter in self.engine_counters.items():
            now, before = getattr(stats, field), seen.get(field, 0)
            if now > before:
                counter.inc((now - before) * _ENGINE_COUNTERS[field][2])
                seen[field] = now
        self._seen_by_engine[stats.engine_id] = seen  # re-inserted last: the oldest are dropped first
        while len(self._seen_by_engine) > _MAX_ENGINES:
            del self._seen_by_engine[next(iter(self._seen_by_engine))]

    def refresh_devices(self, devices: Sequence[DeviceMemoryStats]) -> None:
        """Take a fresh snapshot of every device's HMM memory."""
        self.num_devices.set(len(devices))
        for gauge in (self.device_capacity, self.device_used, self.device_peak, self.device_layout):
            gauge.clear()
        for d in devices:
            device = str(d.device_id)
            self.device_capacity.labels(device).set(d.capacity_bytes)
            self.device_used.labels(device).set(d.used_bytes)
            self.device_peak.labels(device).set(d.peak_bytes)
            for kind, num_bytes in d.layout_bytes.items():
                self.device_layout.labels(device, kind).set(num_bytes)

    def refresh_adapters(self, slots: Sequence[AdapterSlotStats], swaps: Mapping[str, Any]) -> None:
        for s in slots:
            self.adapters_loaded.labels(s.kind).set(s.num_loaded)
            self.adapter_slots.labels(s.kind).set(s.num_slots)
        self.esft_resident.set(swaps["esft_resident"])
        self.esft_swaps.labels("in").set(swaps["esft_swaps_in"])
        self.esft_swaps.labels("out").set(swaps["esft_evictions"])

    def render(self) -> bytes:
        return generate_latest(self.registry)
