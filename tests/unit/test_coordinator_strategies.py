"""Scale strategies: the named set, their switches (paper §7.2 baselines, cumulative Table 1
ablations) and the metrics each finished scale event leaves in /metrics."""

from __future__ import annotations

import pytest

from coordinator.metrics import ClusterMetrics
from coordinator.scale_events import ScaleEvents
from coordinator.strategies import ABLATIONS, BASELINES, STRATEGIES, strategy


def test_names_and_unknown_strategy_names_the_field():
    assert set(BASELINES) | set(ABLATIONS) == set(STRATEGIES)
    with pytest.raises(ValueError, match=r"^strategy: must be one of .*'warp'"):
        strategy("warp")
    with pytest.raises(ValueError, match="^strategy"):
        strategy(None)  # type: ignore[arg-type]


def test_elastic_uses_every_mechanism_and_hands_kv_over():
    s = strategy("elastic")
    t = s.transition
    assert t.zero_copy and t.paged_remap and t.p2p and s.preinit and s.hands_over_kv


def test_ablations_are_cumulative():
    switches = [
        (s.transition.paged_remap, s.transition.p2p, s.preinit, s.transition.zero_copy)
        for s in map(strategy, ABLATIONS)
    ]
    assert switches == [
        (True, True, True, True),
        (False, True, True, True),
        (False, False, True, True),
        (False, False, False, True),
        (False, False, False, False),
    ]
    assert [strategy(n).hands_over_kv for n in ABLATIONS] == [True, True, True, True, False]


def test_baselines_load_from_disk_without_preinit_and_recompute():
    for name in ("cold_restart", "extravagant", "concurrent"):
        s = strategy(name)
        assert not (s.preinit or s.transition.p2p or s.transition.zero_copy or s.hands_over_kv)
    assert strategy("cold_restart").placement == "stop_first"
    assert strategy("extravagant").placement == "fresh_devices"
    assert strategy("concurrent").placement == "in_place"


def test_scale_events_reach_the_metrics():
    metrics = ClusterMetrics(lambda: 1.0)
    events = ScaleEvents(on_finished=metrics.on_scale_finished)
    ok = events.start(1, 2, "elastic")
    ok.scale_latency_s, ok.downtime_s, ok.peak_memory_bytes = 1.5, 0.02, 123456
    events.finish(ok)
    bad = events.start(2, 3, "cold_restart")
    events.finish(bad, error="injected")
    text = metrics.render().decode()
    assert 'elasticmoe_scale_events_total{outcome="succeeded",strategy="elastic"} 1.0' in text
    assert 'elasticmoe_scale_events_total{outcome="rolled_back",strategy="cold_restart"} 1.0' in text
    assert 'elasticmoe_scale_latency_seconds_sum{strategy="elastic"} 1.5' in text
    assert 'elasticmoe_scale_downtime_seconds_count{strategy="elastic"} 1.0' in text
    assert 'elasticmoe_scale_last_peak_memory_bytes{strategy="elastic"} 123456.0' in text
    assert 'elasticmoe_scale_latency_seconds_count{strategy="cold_restart"}' not in text
