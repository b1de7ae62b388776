"""The Grafana dashboards of deploy/grafana/ against the metrics the elastic server exports.

Each dashboard parses, picks its datasource through the `DS_PROMETHEUS` variable, every
panel (rows aside) queries Prometheus, and every `elasticmoe_*` name in a panel or
annotation expression is a sample name of the coordinator's registry (or of the SLO /
autoscaler gauges registered on it). Every exported metric is documented in docs/operations.md.
The queries themselves run against a live server in
tests/integration/test_prometheus_dashboards.py.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from coordinator.ingress_metrics import IngressMetrics
from coordinator.metrics import ClusterMetrics

ROOT = Path(__file__).resolve().parents[2]
DASHBOARDS = sorted((ROOT / "deploy" / "grafana").glob("*.json"))
DS = "${DS_PROMETHEUS}"
# Registered on the same registry by the SLO estimator / autoscaler loop (coordinator.autoscale_loop).
SLO_METRICS = {
    "elasticmoe_slo_attainment_ratio",
    "elasticmoe_slo_ttft_target_seconds",
    "elasticmoe_slo_tpot_target_seconds",
    "elasticmoe_load_rps",
    "elasticmoe_autoscaler_enabled",
    "elasticmoe_autoscaler_desired_dp",
    "elasticmoe_autoscaler_decisions_total",
}
_NAME = re.compile(r"\belasticmoe_[a-zA-Z0-9_]+")


def coordinator_families() -> dict[str, set[str]]:
    """Metric family name -> its sample names (`_total`, `_bucket`, ...), labelled series included."""
    ingress = IngressMetrics(lambda: 0.0, lambda: True, dict, lambda: (0, 0))
    cluster = ClusterMetrics(lambda: 1.0)
    families: dict[str, set[str]] = {}
    for family in [*ingress.registry.collect(), *cluster.registry.collect()]:
        names = {s.name for s in family.samples}
        # a labelled metric without a series yet has no samples: name its usual samples
        suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count")}.get(family.type, ("",))
        families[family.name] = names | {family.name + s for s in suffixes}
    return families


def panel_queries(dashboard: dict) -> list[tuple[str, str]]:
    """(panel title, expr) of every panel target and Prometheus annotation."""
    out = []
    for panel in dashboard["panels"]:
        out += [(panel["title"], t["expr"]) for t in panel.get("targets", []) if t.get("expr")]
    for ann in dashboard["annotations"]["list"]:
        if ann.get("expr"):
            out.append((f"annotation {ann['name']}", ann["expr"]))
    return out


@pytest.fixture(scope="module")
def exported() -> set[str]:
    return {name for names in coordinator_families().values() for name in names} | SLO_METRICS


def test_there_are_dashboards():
    assert len(DASHBOARDS) >= 2, DASHBOARDS


@pytest.mark.parametrize("path", DASHBOARDS, ids=lambda p: p.name)
def test_dashboard_is_well_formed(path):
    dashboard = json.loads(path.read_text())
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["DS_PROMETHEUS"]["type"] == "datasource"
    assert variables["DS_PROMETHEUS"]["query"] == "prometheus"
    assert dashboard["uid"] and dashboard["title"]
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    for panel in dashboard["panels"]:
        if panel["type"] == "row":
            continue
        assert panel["datasource"]["uid"] == DS, panel["title"]
        targets = panel.get("targets", [])
        assert targets and all(t.get("expr") for t in targets), f"{panel['title']}: a target without expr"
        assert all(t["datasource"]["uid"] == DS for t in targets), panel["title"]
        refs = [t["refId"] for t in targets]
        assert len(refs) == len(set(refs)), panel["title"]
    annotations = [a for a in dashboard["annotations"]["list"] if a.get("expr")]
    assert annotations, "scale events must be annotated"
    assert all(a["datasource"]["uid"] == DS for a in annotations)


@pytest.mark.parametrize("path", DASHBOARDS, ids=lambda p: p.name)
def test_every_metric_in_a_query_is_exported(path, exported):
    for title, expr in panel_queries(json.loads(path.read_text())):
        names = _NAME.findall(expr)
        assert names, f"{title}: {expr!r} reads no elasticmoe_ metric"
        unknown = sorted(set(names) - exported)
        assert not unknown, f"{title}: {unknown} are not exported by the server"
        assert expr.count("(") == expr.count(")") and expr.count("[") == expr.count("]"), title
        # the integration test substitutes these for its instant queries
        assert set(re.findall(r"\$\{?\w+", expr)) <= {"$__rate_interval", "$__interval", "$__range"}, title


def test_every_metric_is_documented():
    doc = (ROOT / "docs" / "operations.md").read_text()
    documented = set(re.findall(r"`(elasticmoe_[a-zA-Z0-9_]+)", doc))
    families = coordinator_families()
    exposed = {name + "_total" if f"{name}_total" in samples else name for name, samples in families.items()}
    missing = sorted((exposed | SLO_METRICS) - documented)
    assert not missing, f"docs/operations.md lacks {missing}"


def test_lora_counters_add_growth_per_engine_and_ignore_stale_snapshots():
    from imm.rank_stats import RankStats

    def stats(engine: str, hits: int, rank: int = 0) -> RankStats:
        return RankStats(rank, 0, 0, 10, 5, 1, engine_id=engine, num_lora_slots=2, num_lora_resident=1,
                         num_lora_hits=hits, lora_slot_bytes=4096)

    metrics = ClusterMetrics(lambda: 1.0)
    registry = metrics.registry

    def hits() -> float | None:
        return registry.get_sample_value("elasticmoe_lora_hits_total")

    metrics.refresh([stats("a", 3), stats("b", 2, rank=1)])
    assert hits() == 5
    metrics.refresh([stats("a", 4), stats("b", 1, rank=1)])  # b's snapshot raced an older scrape
    assert hits() == 6
    metrics.refresh([stats("c", 2)])  # a new instance after a scale: its engines start at 0
    assert hits() == 8
    assert registry.get_sample_value("elasticmoe_lora_slots_used", {"rank": "0"}) == 1
    assert registry.get_sample_value("elasticmoe_lora_slots_used", {"rank": "1"}) is None  # rank 1 retired
    assert registry.get_sample_value("elasticmoe_lora_slot_bytes", {"rank": "0"}) == 4096
    assert registry.get_sample_value("elasticmoe_lora_slot_bytes", {"rank": "1"}) is None
    assert registry.get_sample_value("elasticmoe_kv_cache_usage_ratio", {"rank": "0"}) == 0.5
    metrics.refresh([RankStats(0, 0, 0, 10, 5, 1, engine_id="c", lora_swap_us=1_500_000, arrange_us=250)])
    value = registry.get_sample_value  # the timers count microseconds and export seconds
    assert value("elasticmoe_lora_swap_seconds_total") == pytest.approx(1.5)
    assert value("elasticmoe_request_arranging_seconds_total") == pytest.approx(0.00025)


def test_device_and_adapter_snapshots():
    from coordinator.memory_stats import AdapterSlotStats, DeviceMemoryStats

    metrics = ClusterMetrics(lambda: 1.0)
    registry = metrics.registry
    layout = {"weights": 60, "kv": 30, "adapters": 5}
    metrics.refresh_devices([DeviceMemoryStats(0, 200, 100, 150, layout), DeviceMemoryStats(1, 200, 0, 0, {})])
    metrics.refresh_adapters([AdapterSlotStats("esft", 1, 4), AdapterSlotStats("lora", 0, 2)],
                             {"esft_resident": 1, "esft_swaps_in": 2, "esft_evictions": 1})
    value = registry.get_sample_value
    assert value("elasticmoe_num_devices") == 2
    assert value("elasticmoe_device_memory_used_bytes", {"device": "0"}) == 100
    assert value("elasticmoe_device_memory_peak_bytes", {"device": "0"}) == 150
    assert value("elasticmoe_device_memory_capacity_bytes", {"device": "1"}) == 200
    assert value("elasticmoe_device_memory_layout_bytes", {"device": "0", "kind": "kv"}) == 30
    assert value("elasticmoe_device_memory_layout_bytes", {"device": "1", "kind": "kv"}) is None
    assert value("elasticmoe_adapters_loaded", {"kind": "esft"}) == 1
    assert value("elasticmoe_adapter_slots", {"kind": "lora"}) == 2
    metrics.refresh_devices([DeviceMemoryStats(0, 200, 90, 150, layout)])  # a device went away
    assert value("elasticmoe_num_devices") == 1
    assert value("elasticmoe_device_memory_used_bytes", {"device": "1"}) is None


def test_the_two_registries_share_no_metric():
    ingress = {f.name for f in IngressMetrics(lambda: 0.0, lambda: True, dict, lambda: (0, 0)).registry.collect()}
    cluster = {f.name for f in ClusterMetrics(lambda: 1.0).registry.collect()}
    assert ingress and cluster and not ingress & cluster  # one /metrics body, each family once


def test_expert_cache_counters_add_growth_per_engine_with_the_single_servers_labels():
    from imm.rank_stats import RankStats

    def stats(engine: str, lookups: int, hits: int, on_demand: int, rank: int = 0) -> RankStats:
        return RankStats(rank, 0, 0, 10, 10, 1, engine_id=engine, expert_cache_capacity=8, expert_cache_resident=6,
                         num_expert_lookups=lookups, num_expert_hits=hits, num_expert_loads_on_demand=on_demand,
                         num_expert_loads_prefetch=2, expert_bytes_loaded_host=1000 * (on_demand + 2))

    metrics = ClusterMetrics(lambda: 1.0)
    value = metrics.registry.get_sample_value
    assert value("elasticmoe_expert_loads_total", {"kind": "on_demand"}) == 0  # exported before any load
    metrics.refresh([stats("a", 10, 7, 3), stats("b", 4, 4, 0, rank=1)])
    metrics.refresh([stats("a", 12, 8, 4), stats("b", 4, 4, 0, rank=1)])
    assert value("elasticmoe_expert_cache_lookups_total") == 16 and value("elasticmoe_expert_cache_hits_total") == 12
    assert value("elasticmoe_expert_loads_total", {"kind": "on_demand"}) == 4
    assert value("elasticmoe_expert_loads_total", {"kind": "prefetch"}) == 4
    assert value("elasticmoe_expert_bytes_loaded_total", {"tier": "host"}) == 1000 * (6 + 2)
    assert value("elasticmoe_expert_cache_resident_experts", {"rank": "1"}) == 6
    assert value("elasticmoe_expert_cache_capacity_experts", {"rank": "0"}) == 8
    metrics.refresh([RankStats(0, 0, 0, 10, 10, 1, engine_id="c")])  # a rank without offloading: no gauge
    assert value("elasticmoe_expert_cache_capacity_experts", {"rank": "0"}) is None


def test_prefix_cache_counters_add_growth_per_engine():
    from imm.rank_stats import RankStats

    def stats(engine: str, queries: int, hits: int, rank: int = 0) -> RankStats:
        return RankStats(rank, 0, 0, 10, 10, 1, engine_id=engine, num_prefix_cache_queries=queries,
                         num_prefix_cache_hits=hits)

    metrics = ClusterMetrics(lambda: 1.0)
    value = metrics.registry.get_sample_value
    metrics.refresh([stats("a", 100, 40), stats("b", 50, 0, rank=1)])
    metrics.refresh([stats("a", 180, 96), stats("b", 50, 0, rank=1), stats("c", 20, 16, rank=0)])  # a scale
    assert value("elasticmoe_prefix_cache_queries_total") == 250 and value("elasticmoe_prefix_cache_hits_total") == 112
