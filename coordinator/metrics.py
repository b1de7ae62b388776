"""Prometheus metrics of the coordinator: the OpenAI server's set plus cluster gauges.

Composes `ServerMetrics` (HTTP request counts by endpoint and status, TTFT and
e2e histograms, token counters, running/waiting gauges) with TPOT, queue
length, KV usage and the active configuration, all in that one registry.

Rank counters live in the rank actors; `refresh(stats)` copies a snapshot in,
and the gauges read the snapshot, so rendering never blocks on Ray.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from prometheus_client import Gauge, Histogram

from elasticmoe.entrypoints.openai.metrics import ServerMetrics
from elasticmoe.entrypoints.openai.serving import RequestStats
from imm.rank import RankStats

_TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


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
