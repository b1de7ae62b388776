"""Prometheus metrics of the ingress: what clients see.

`ServerMetrics` (HTTP request counts by endpoint and status, TTFT and e2e histograms, token
counters) plus TPOT, the requests admitted (queue bound), readiness, what `/health` lists, and
the requests that survived an instance failure. `/metrics` renders these, then the
coordinator's (`coordinator.metrics.ClusterMetrics`). docs/operations.md lists every metric.
"""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import Gauge, Histogram
from prometheus_client.core import CounterMetricFamily

from elasticmoe.entrypoints.openai.metrics import ServerMetrics
from elasticmoe.entrypoints.openai.serving import RequestStats

_TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


class IngressMetrics:
    """The observer of `OpenAIServing` and the first part of `/metrics`."""

    def __init__(
        self,
        num_queued: Callable[[], float],
        is_ready: Callable[[], bool],
        faults: Callable[[], dict[str, str]],
        recoveries: Callable[[], tuple[int, int]],
    ) -> None:
        """`recoveries()` = (requests continued on another instance after theirs failed, output
        tokens recomputed for them)."""
        self.server = ServerMetrics()
        registry = self.registry = self.server.registry
        self.tpot = Histogram(
            "elasticmoe_time_per_output_token_seconds",
            "Mean time between output tokens of a finished request (after the first).",
            ["endpoint"],
            buckets=_TPOT_BUCKETS,
            registry=registry,
        )
        Gauge(
            "elasticmoe_num_requests_queued",
            "Requests admitted by the ingress: held or in flight (bounded by --max-queued).",
            registry=registry,
        ).set_function(num_queued)
        Gauge("elasticmoe_ready", "1 while an instance serves requests (what /ready says), else 0.",
              registry=registry).set_function(lambda: float(is_ready()))
        Gauge("elasticmoe_degraded_components",
              "Components that failed and are being repaired (what /health lists).",
              registry=registry).set_function(lambda: float(len(faults())))
        registry.register(_RecoveryCounters(recoveries))

    def on_request_finished(self, stats: RequestStats) -> None:
        self.server.on_request_finished(stats)
        if stats.ttft_s is not None and stats.num_output_tokens > 1:
            tpot = (stats.e2e_s - stats.ttft_s) / (stats.num_output_tokens - 1)
            self.tpot.labels(stats.endpoint).observe(tpot)

    def render(self) -> bytes:
        return self.server.render()[0]


class _RecoveryCounters:
    """Counters read from the engine client at scrape time (it counts; nothing to copy)."""

    def __init__(self, recoveries: Callable[[], tuple[int, int]]) -> None:
        self.recoveries = recoveries

    def collect(self):  # noqa: ANN201 - prometheus_client's collector protocol
        requests, tokens = self.recoveries()
        yield CounterMetricFamily("elasticmoe_requests_recovered",
                                  "Requests that continued on another instance after theirs failed.", value=requests)
        yield CounterMetricFamily("elasticmoe_tokens_recomputed",
                                  "Output tokens those requests had, whose KV was recomputed.", value=tokens)
