"""The SLO estimator and the autoscaling policy on a fake clock (no server)."""

from __future__ import annotations

import math

import pytest
from prometheus_client import CollectorRegistry

from coordinator.autoscale_loop import AutoscaleLoop
from coordinator.autoscaler import Action, AutoscaleConfig, Autoscaler
from coordinator.scale_events import ScaleEvent, ScaleState
from coordinator.slo import SloSnapshot, SloTargets, SloTracker, tpot_of
from elasticmoe.entrypoints.openai.errors import OpenAIError
from elasticmoe.entrypoints.openai.serving import RequestStats


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def stats(ttft: float | None, tpot: float, n: int = 5, finish: str = "length") -> RequestStats:
    e2e = (ttft or 0.0) + tpot * (n - 1)
    return RequestStats("completions", 8, n if ttft is not None else 0, ttft, e2e, finish)


# ---- SloTracker ------------------------------------------------------------------------------


def test_attainment_needs_both_targets_and_counts_failures():
    clock = Clock()
    tracker = SloTracker(SloTargets(ttft_s=1.0, tpot_s=0.1), window_s=10, clock=clock)
    tracker.on_request_finished(stats(0.5, 0.05))  # met
    tracker.on_request_finished(stats(1.5, 0.05))  # TTFT too slow
    tracker.on_request_finished(stats(0.5, 0.2))  # TPOT too slow
    tracker.on_request_finished(stats(0.5, 0.05, finish="error"))
    tracker.on_request_failed()
    clock.t += 1
    snap = tracker.snapshot()
    assert (snap.num_finished, snap.num_met) == (5, 1)
    assert snap.attainment == pytest.approx(0.2)


def test_window_slides_and_reset_forgets():
    clock = Clock()
    tracker = SloTracker(SloTargets(1.0, 1.0), window_s=10, clock=clock)
    for _ in range(4):
        tracker.on_arrival()
        tracker.on_request_failed()
        clock.t += 1
    clock.t += 20  # 10 s window: all four are older
    for _ in range(3):
        tracker.on_arrival()
        tracker.on_request_finished(stats(0.1, 0.01))
    snap = tracker.snapshot()
    assert snap.num_finished == 3 and snap.attainment == 1.0
    assert snap.arrival_rps == pytest.approx(3 / 10)
    tracker.reset()
    clock.t += 2
    snap = tracker.snapshot()
    assert snap.num_finished == 0 and snap.attainment is None and snap.window_s == pytest.approx(2)


def test_tpot_of_single_token_and_no_token():
    assert tpot_of(stats(0.3, 0.0, n=1)) == 0.0
    assert tpot_of(RequestStats("completions", 4, 0, None, 1.0, "abort")) is None
    assert tpot_of(stats(0.2, 0.05, n=11)) == pytest.approx(0.05)


def test_p90():
    clock = Clock()
    tracker = SloTracker(SloTargets(10.0, 10.0), window_s=100, clock=clock)
    for i in range(1, 11):
        tracker.on_request_finished(stats(float(i), 0.01))
    assert tracker.snapshot().ttft_p90_s == 9.0


# ---- Autoscaler policy ------------------------------------------------------------------------


def snap(attainment: float | None, finished: int = 50, rps: float = 5.0, window: float = 20.0,
         ttft_p90: float | None = 0.1, tpot_p90: float | None = 0.01) -> SloSnapshot:
    met = 0 if attainment is None else round(attainment * finished)
    return SloSnapshot(window, finished, met, attainment, rps, finished / window, ttft_p90, tpot_p90)


def policy(**overrides) -> Autoscaler:
    cfg = dict(enabled=True, min_dp=1, max_dp=3, scale_up_after_s=5, scale_down_after_s=10, cooldown_s=30,
               min_samples=10, slo_ttft_s=1.0, slo_tpot_s=0.1)
    cfg.update(overrides)
    return Autoscaler(AutoscaleConfig(**cfg), num_devices=4)


def test_scale_up_only_after_persistent_violation():
    p = policy()
    assert p.evaluate(0, snap(0.5), 1, False).action is Action.HOLD
    assert p.evaluate(3, snap(0.5), 1, False).action is Action.HOLD
    assert p.evaluate(4, snap(0.95), 1, False).action is Action.HOLD  # recovered: timer resets
    assert p.evaluate(6, snap(0.5), 1, False).action is Action.HOLD
    decision = p.evaluate(11, snap(0.5, finished=40, window=20), 1, False)
    assert decision.action is Action.SCALE_UP and decision.target_dp == 2
    assert p.rank_capacity_rps == pytest.approx(2.0)  # 40 finished in 20 s on one rank
    assert p.desired_dp == 2 and list(p.decisions) == [decision]


def test_never_beyond_bounds():
    p = policy(max_dp=2)
    for t in range(0, 30, 1):
        d = p.evaluate(t, snap(0.2), 2, False)
        assert d.action is Action.HOLD
    assert "max dp 2" in d.reason
    q = policy(min_dp=2)
    for t in range(0, 60, 1):
        d = q.evaluate(t, snap(1.0, rps=0.1), 2, False)
        assert d.action is Action.HOLD
    assert "min dp 2" in d.reason


def test_hysteresis_band_holds_both_ways():
    p = policy()
    for t in range(0, 100, 1):
        assert p.evaluate(t, snap(0.95), 2, False).action is Action.HOLD  # 0.9 <= 0.95 < 0.99


def test_scale_down_with_latency_headroom_when_capacity_unknown():
    p = policy()
    assert p.evaluate(0, snap(1.0), 2, False).action is Action.HOLD
    assert p.evaluate(9, snap(1.0), 2, False).action is Action.HOLD
    d = p.evaluate(10, snap(1.0), 2, False)
    assert d.action is Action.SCALE_DOWN and d.target_dp == 1
    slow = policy()
    for t in range(0, 30):  # attainment is fine but p90 TTFT is at 0.8 x target: would not fit
        assert slow.evaluate(t, snap(1.0, ttft_p90=0.8), 2, False).action is Action.HOLD


def test_scale_down_uses_learned_capacity():
    p = policy(rank_capacity_rps=2.0)
    # 3 rps over dp 2 -> 3 rps on one rank > 0.7 x 2.0: keep dp 2 however good attainment is.
    for t in range(0, 40):
        d = p.evaluate(t, snap(1.0, rps=3.0), 2, False)
        assert d.action is Action.HOLD
    assert "would not fit" in d.reason
    q = policy(rank_capacity_rps=2.0)
    actions = [q.evaluate(t, snap(1.0, rps=1.0), 2, False).action for t in range(0, 11)]
    assert actions[-1] is Action.SCALE_DOWN


def test_idle_scales_down_after_a_full_window():
    p = policy()
    # Right after a reset the window is short: no decision on an empty short window.
    assert p.evaluate(0, snap(None, finished=0, rps=0.0, window=2.0), 2, False).action is Action.HOLD
    actions = [p.evaluate(t, snap(None, finished=0, rps=0.0, window=20.0), 2, False).action for t in range(1, 12)]
    assert actions[-1] is Action.SCALE_DOWN
    # A few slow requests are not "idle and comfortable".
    q = policy()
    for t in range(0, 30):
        assert q.evaluate(t, snap(0.0, finished=3, rps=0.15), 2, False).action is Action.HOLD


def test_cooldown_and_running_scale_and_pause():
    p = policy()
    p.on_scale_finished(100.0, succeeded=True)
    for t in range(100, 130):
        d = p.evaluate(t, snap(0.1), 1, False)
        assert d.action is Action.HOLD and "cooldown" in d.reason
    assert p.evaluate(131, snap(0.1), 1, True).reason == "a scale is running"
    p.pause("manual scale scale-7")
    d = p.evaluate(200, snap(0.1), 1, False)
    assert d.action is Action.HOLD and "manual scale" in d.reason
    p.resume()
    assert p.evaluate(201, snap(0.1), 1, False).action is Action.HOLD  # persistence starts again
    assert p.evaluate(206, snap(0.1), 1, False).action is Action.SCALE_UP


def test_disabled_never_acts():
    p = policy(enabled=False)
    for t in range(100):
        assert p.evaluate(t, snap(0.0), 1, False).action is Action.HOLD


@pytest.mark.parametrize(
    "overrides, option",
    [
        ({"min_dp": 0}, "--autoscale-min-dp"),
        ({"min_dp": 3, "max_dp": 2}, "--autoscale-max-dp"),
        ({"target_attainment": 0.99, "scale_down_attainment": 0.9}, "--autoscale-target-attainment"),
        ({"window_s": 0}, "--autoscale-window-s"),
        ({"cooldown_s": -1}, "--autoscale-cooldown-s"),
        ({"scale_down_headroom": 1.5}, "--autoscale-scale-down-headroom"),
        ({"strategy": "teleport"}, "--autoscale-strategy"),
    ],
)
def test_config_errors_name_the_option(overrides, option):
    with pytest.raises(ValueError, match=option):
        AutoscaleConfig(**overrides)


def test_config_from_mapping_rejects_unknown_keys():
    assert AutoscaleConfig.model_validate({"enabled": True, "max_dp": 3}).max_dp == 3
    with pytest.raises(ValueError, match="max_replicas"):
        AutoscaleConfig.model_validate({"max_replicas": 3})


def test_min_dp_above_devices_is_an_error():
    with pytest.raises(ValueError, match="--autoscale-min-dp"):
        Autoscaler(AutoscaleConfig(min_dp=3), num_devices=2)


# ---- AutoscaleLoop ---------------------------------------------------------------------------


def make_loop(start_scale, dp=1, registry=None):
    clock = Clock()
    tracker = SloTracker(SloTargets(1.0, 0.1), window_s=20, clock=clock)
    loop = AutoscaleLoop(policy(scale_up_after_s=0), tracker, start_scale, lambda: dp, lambda: False,
                         registry or CollectorRegistry(), clock=clock)
    return loop, tracker, clock


def counter_value(loop: AutoscaleLoop, action: str, outcome: str) -> float:
    return loop.decisions_counter.labels(action, outcome)._value.get()


def test_loop_starts_scales_and_records_outcomes():
    calls = []

    def start(dp, strategy):
        calls.append((dp, strategy))
        return "scale-1"

    loop, tracker, clock = make_loop(start)
    for _ in range(20):
        tracker.on_request_failed()
    decision = loop.tick()
    assert decision.action is Action.SCALE_UP and decision.outcome == "started" and decision.event_id == "scale-1"
    assert calls == [(2, "elastic")]
    assert counter_value(loop, "scale_up", "started") == 1
    # The scale finishes: cooldown starts and old violations are forgotten.
    loop.on_scale_finished(ScaleEvent("scale-1", 1, 2, "elastic", state=ScaleState.SUCCEEDED))
    assert tracker.snapshot().num_finished == 0
    assert "cooldown" in loop.tick().reason


def test_loop_records_a_rejected_scale():
    def start(dp, strategy):
        raise OpenAIError("cannot scale while adapter x is loading", status_code=409, param="dp")

    loop, tracker, clock = make_loop(start)
    for _ in range(20):
        tracker.on_request_failed()
    decision = loop.tick()
    assert decision.outcome == "rejected" and "adapter" in decision.error
    assert loop.policy.desired_dp is None
    assert counter_value(loop, "scale_up", "rejected") == 1


def test_loop_gauges():
    registry = CollectorRegistry()
    loop, tracker, clock = make_loop(lambda dp, s: "x", registry=registry)
    # Attainment is NaN without samples (not 1.0: nothing was observed).
    assert math.isnan(registry.get_sample_value("elasticmoe_slo_attainment_ratio"))
    tracker.on_request_finished(stats(0.1, 0.01))
    assert registry.get_sample_value("elasticmoe_slo_attainment_ratio") == 1.0
    assert registry.get_sample_value("elasticmoe_slo_ttft_target_seconds") == 1.0
    assert registry.get_sample_value("elasticmoe_autoscaler_enabled") == 1.0
    assert registry.get_sample_value("elasticmoe_autoscaler_desired_dp") == 1.0
    assert registry.get_sample_value("elasticmoe_autoscaler_decisions_total",
                                     {"action": "scale_down", "outcome": "failed"}) == 0.0
