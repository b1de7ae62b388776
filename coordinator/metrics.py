"""Prometheus metrics of the coordinator: the OpenAI server's set plus cluster gauges.

Composes `ServerMetrics` (HTTP request counts by endpoint and status, TTFT and
e2e histograms, token counters, running/waiting gauges) with TPOT, queue
length, KV usage, the active configuration and scale events (count by strategy
and outcome; latency, downtime and peak memory of each), all in that one registry.

Rank counters live in the rank actors; `refresh(stats)` copies a snapshot in,
and the gauges read the snapshot, so rendering never blocks on Ray.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from prometheus_client import Counter, Gauge, Histogram

from coordinator.scale_events import ScaleEvent
from elasticmoe.entrypoints.openai.metrics import ServerMetrics
from elasticmoe.entrypoints.openai.serving import RequestStats
from imm.rank import RankStats

_TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
_SCALE_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)


class CoordinatorMetrics:
    """The observer of `OpenAIServing` and the source of `/metrics`."""

    def __init__(self, num_queued: Callable[[], float], active_dp: Callable[[], float]) -> None:
        self._stats: list[RankStats] = []
        self.server = ServerMetrics(
            lambda: sum(s.num_running for s in self._stats), lambda: sum(s.num_waiting for s in self._stats)
        )
        registry = self.server.registry
        self.tpot = Histogram(
            "elasticmoe_time_per_output_token_seconds",
            "Mean time between output tokens of a finished request (after the first).",
            ["endpoint"],
            buckets=_TPOT_BUCKETS,
            registry=registry,
        )
        Gauge(
            "elasticmoe_num_requests_queued",
            "Requests admitted by the coordinator: waiting at the router or in flight (bounded by --max-queued).",
            registry=registry,
        ).set_function(num_queued)
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
        self.last_scale = Gauge(
            "elasticmoe_scale_last_finished_timestamp_seconds",
            "Unix time at which the last scale event finished (Grafana annotations).",
            registry=registry,
        )

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
        self.kv_usage.clear()
        for s in self._stats:
            self.kv_usage.labels(str(s.rank)).set(s.kv_usage)

    def on_request_finished(self, stats: RequestStats) -> None:
        self.server.on_request_finished(stats)
        if stats.ttft_s is not None and stats.num_output_tokens > 1:
            tpot = (stats.e2e_s - stats.ttft_s) / (stats.num_output_tokens - 1)
            self.tpot.labels(stats.endpoint).observe(tpot)

    def render(self) -> tuple[bytes, str]:
        return self.server.render()
