"""Prometheus metrics for one API server, in a registry of its own.

Each app gets a fresh `CollectorRegistry`, so several apps (tests, a coordinator
hosting more than one) never collide on metric names in the global registry.
"""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from elasticmoe.entrypoints.openai.serving import RequestStats

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)


class ServerMetrics:
    """HTTP request counts, TTFT/e2e histograms, token counters and, given an engine's counts,
    its queue gauges (the elastic server's ingress has none: the coordinator exports them)."""

    def __init__(
        self, num_running: Callable[[], float] | None = None, num_waiting: Callable[[], float] | None = None
    ) -> None:
        self.registry = CollectorRegistry()
        self.http_requests = Counter(
            "elasticmoe_http_requests",
            "HTTP requests by endpoint and status code.",
            ["endpoint", "status"],
            registry=self.registry,
        )
        self.ttft = Histogram(
            "elasticmoe_time_to_first_token_seconds",
            "Time from request arrival to the first output token.",
            ["endpoint"],
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.adapter_ttft = Histogram(
            "elasticmoe_adapter_time_to_first_token_seconds",
            "Time to first token of requests that named an adapter, by whether it was resident on arrival "
            "(state=resident) or the request waited for its swap-in (state=swapped): what switching costs.",
            ["endpoint", "state"],
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.e2e = Histogram(
            "elasticmoe_e2e_request_latency_seconds",
            "Time from request arrival to its last token.",
            ["endpoint"],
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.prompt_tokens = Counter(
            "elasticmoe_prompt_tokens",
            "Prompt tokens of finished requests.",
            ["endpoint"],
            registry=self.registry,
        )
        self.generation_tokens = Counter(
            "elasticmoe_generation_tokens",
            "Generated tokens of finished requests.",
            ["endpoint"],
            registry=self.registry,
        )
        if num_running is not None and num_waiting is not None:
            register_engine_queue(self.registry, num_running, num_waiting)

    def on_request_finished(self, stats: RequestStats) -> None:
        if stats.ttft_s is not None:
            self.ttft.labels(stats.endpoint).observe(stats.ttft_s)
            if stats.adapter_state is not None:
                self.adapter_ttft.labels(stats.endpoint, stats.adapter_state).observe(stats.ttft_s)
        self.e2e.labels(stats.endpoint).observe(stats.e2e_s)
        self.prompt_tokens.labels(stats.endpoint).inc(stats.num_prompt_tokens)
        self.generation_tokens.labels(stats.endpoint).inc(stats.num_output_tokens)

    def render(self) -> tuple[bytes, str]:
        """The exposition text and its content type."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST


def register_engine_queue(
    registry: CollectorRegistry, num_running: Callable[[], float], num_waiting: Callable[[], float]
) -> None:
    Gauge("elasticmoe_num_requests_running", "Requests being processed by the engine.",
          registry=registry).set_function(num_running)
    Gauge("elasticmoe_num_requests_waiting", "Requests queued in the engine.", registry=registry).set_function(
        num_waiting)


class ExpertCacheCollector:
    """The engine's expert cache (offloading) as Prometheus metrics, read at scrape time from
    `stats()` (`elasticmoe.engine.expert_cache.ExpertCache.stats`)."""

    def __init__(self, stats: Callable[[], dict]) -> None:
        self.stats = stats

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        s = self.stats()
        yield GaugeMetricFamily("elasticmoe_expert_cache_capacity_experts", "Expert rows the cache's budget buys.",
                                value=s["capacity_experts"])
        yield GaugeMetricFamily("elasticmoe_expert_cache_resident_experts", "Experts resident in the cache.",
                                value=s["resident_experts"])
        yield GaugeMetricFamily("elasticmoe_expert_cache_hit_rate",
                                "Share of the forward's expert lookups found resident (or being prefetched).",
                                value=s["hit_rate"])
        yield CounterMetricFamily("elasticmoe_expert_cache_lookups", "Expert lookups by the forward "
                                  "(one per iteration, layer and routed expert).", value=s["lookups"])
        yield CounterMetricFamily("elasticmoe_expert_cache_hits", "Expert lookups that found the expert resident.",
                                  value=s["hits"])
        loads = CounterMetricFamily("elasticmoe_expert_loads", "Experts copied into the cache, by why.",
                                    labels=["kind"])
        loads.add_metric(["on_demand"], s["on_demand_loads"])
        loads.add_metric(["prefetch"], s["prefetches"])
        yield loads
        prefetches = CounterMetricFamily("elasticmoe_expert_prefetches", "Prefetched experts by outcome: used "
                                         "before they left, evicted unused, or failed to load.", labels=["outcome"])
        for outcome, key in (("useful", "prefetches_useful"), ("wasted", "prefetches_wasted"),
                             ("failed", "prefetch_failures")):
            prefetches.add_metric([outcome], s[key])
        yield prefetches
        loaded = CounterMetricFamily("elasticmoe_expert_bytes_loaded", "Bytes copied into the expert cache, by "
                                     "the tier they came from.", labels=["tier"])
        for key, value in s.items():
            if key.startswith("bytes_loaded_"):
                loaded.add_metric([key.removeprefix("bytes_loaded_")], value)
        yield loaded


class KVCacheCollector:
    """The engine's KV pool and prefix cache as Prometheus metrics, read at scrape time from
    `stats()` (`elasticmoe.engine.block_manager.BlockManager.stats`; the elastic server's
    coordinator exports the same counters summed over its ranks)."""

    def __init__(self, stats: Callable[[], dict]) -> None:
        self.stats = stats

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        s = self.stats()
        yield GaugeMetricFamily("elasticmoe_kv_cache_usage_ratio", "Fraction of KV blocks in use.",
                                value=s["usage"])
        yield CounterMetricFamily("elasticmoe_prefix_cache_queries", "Prompt tokens of admitted requests looked "
                                  "up in the prefix cache.", value=s["prefix_cache_queries"])
        yield CounterMetricFamily("elasticmoe_prefix_cache_hits", "Prompt tokens found in the prefix cache (not "
                                  "computed again).", value=s["prefix_cache_hits"])


class RequestCountMiddleware:
    """Count HTTP responses by route and status; unknown paths share the label "other"."""

    def __init__(self, app: ASGIApp, metrics: ServerMetrics, endpoints: frozenset[str]) -> None:
        self.app = app
        self.metrics = metrics
        self.endpoints = endpoints

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = 500  # if the app raises before answering

        async def recording_send(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        path = scope.get("path", "")
        try:
            await self.app(scope, receive, recording_send)
        finally:
            endpoint = path if path in self.endpoints else "other"
            self.metrics.http_requests.labels(endpoint, str(status)).inc()
