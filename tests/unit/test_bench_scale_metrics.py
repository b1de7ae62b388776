"""Scale-event figures on hand-built request timings (coordinator/bench/scale_metrics.py)."""

from __future__ import annotations

import pytest

from coordinator.bench.loadgen import RequestRecord
from coordinator.bench.scale_metrics import (
    EVENT_TAIL_S,
    EventKey,
    Window,
    attains_slo,
    baseline_window,
    event_windows,
    failed_requests,
    latency_ratios,
    max_token_gap,
    output_throughput,
    slo_attainment_bins,
    token_arrivals,
)
from coordinator.bench.scaling import devices_needed, parse_transitions, plan_runs


def make_request(
    arrival_s: float,
    token_times_s: list[float],
    num_tokens: int | None = None,
    status: int = 200,
    error: str | None = None,
    request_id: int = 0,
) -> RequestRecord:
    """A finished request (unless `error`) that streamed one chunk at each of `token_times_s`."""
    n = len(token_times_s) if num_tokens is None else num_tokens
    finished = token_times_s[-1] if token_times_s and error is None and status == 200 else None
    return RequestRecord(request_id, arrival_s, prompt_len=4, max_tokens=n, status=status,
                         token_times_s=list(token_times_s), num_tokens=n, finished_s=finished, error=error)


def test_event_windows_follow_table_2():
    w = event_windows(post_s=10.0, finished_s=13.0, window_s=5.0)
    assert w.before == Window(5.0, 10.0)
    assert w.during == Window(10.0, 13.0)
    assert w.after == Window(13.0, 18.0)
    assert w.event == Window(10.0, 13.0 + EVENT_TAIL_S)
    assert event_windows(10.0, 13.0, 5.0, earliest_s=7.0).before == Window(7.0, 10.0)  # short warm-up


def test_during_spans_a_fixed_length_unless_the_event_is_longer():
    short = event_windows(post_s=10.0, finished_s=10.4, window_s=5.0, during_s=8.0)
    assert short.during == Window(10.0, 18.0) and short.after == Window(18.0, 23.0)
    assert short.event == Window(10.0, 11.4)  # downtime is still looked for around the event itself
    long = event_windows(post_s=10.0, finished_s=30.0, window_s=5.0, during_s=8.0)
    assert long.during == Window(10.0, 30.0) and long.after == Window(30.0, 35.0)


def test_window_is_half_open_and_validated():
    w = Window(1.0, 2.0)
    assert w.contains(1.0) and w.contains(1.999) and not w.contains(2.0) and w.length_s == 1.0
    with pytest.raises(ValueError):
        Window(2.0, 1.0)


def test_baseline_window_ends_at_post_and_is_clipped():
    assert baseline_window(post_s=10.0, length_s=4.0) == Window(6.0, 10.0)
    assert baseline_window(post_s=3.0, length_s=4.0, earliest_s=1.0) == Window(1.0, 3.0)


def test_max_token_gap_spans_streams_and_counts_window_edges():
    a = make_request(0.0, [1.0, 2.0, 3.0, 7.0])  # a stall from 3 to 7 ...
    b = make_request(4.0, [5.0, 5.5])  # ... broken at 5 by a new request's first token
    assert max_token_gap([a, b], Window(0.0, 8.0)) == pytest.approx(2.0)  # 5.5 -> 7
    assert max_token_gap([a], Window(2.5, 8.0)) == pytest.approx(4.0)  # 3 -> 7
    assert max_token_gap([a], Window(3.5, 6.5)) == pytest.approx(3.0)  # no token: the whole window
    assert max_token_gap([a], Window(6.0, 9.0)) == pytest.approx(2.0)  # 7 -> window end


def test_throughput_counts_tokens_by_arrival_with_multi_token_chunks():
    a = make_request(0.0, [1.0, 2.0, 3.0, 4.0])
    b = make_request(0.0, [2.5, 3.5], num_tokens=4)  # two chunks of two tokens each
    assert [n for _, n in token_arrivals([b])] == [2.0, 2.0]
    assert output_throughput([a, b], Window(0.0, 5.0)) == pytest.approx(8 / 5)
    assert output_throughput([a, b], Window(2.0, 4.0)) == pytest.approx((2 + 4) / 2)  # 2.0, 3.0; 2.5, 3.5
    assert output_throughput([a, b], Window(3.0, 3.0)) == 0.0


def test_failed_requests_by_arrival_window_and_total():
    records = [
        make_request(1.0, [1.5]),
        make_request(2.0, [], status=503),
        make_request(3.0, [3.5], error="stream ended without [DONE]"),
        make_request(6.0, [6.5]),
        make_request(7.0, [], status=500),
    ]
    assert failed_requests(records) == 3
    assert failed_requests(records, Window(2.0, 6.0)) == 2
    assert failed_requests(records, Window(4.0, 7.0)) == 0


def test_slo_per_request_ttft_and_tpot():
    ok = make_request(0.0, [0.5, 0.7, 0.9])  # TTFT 0.5, TPOT 0.2
    assert ok.ttft_s == pytest.approx(0.5) and ok.tpot_s == pytest.approx(0.2)
    assert attains_slo(ok, slo_ttft_s=0.5, slo_tpot_s=0.2)
    assert not attains_slo(ok, slo_ttft_s=0.4, slo_tpot_s=1.0)
    assert not attains_slo(ok, slo_ttft_s=1.0, slo_tpot_s=0.1)
    assert attains_slo(make_request(0.0, [0.3]), 0.5, 0.0)  # one token: TTFT only
    assert not attains_slo(make_request(0.0, [0.1], status=500), 1.0, 1.0)


def test_slo_attainment_bins_by_arrival():
    records = [
        make_request(10.2, [10.4, 10.5]),  # bin 0, attains
        make_request(10.8, [13.0, 13.1]),  # bin 0, TTFT 2.2 > 1
        make_request(12.5, [12.6, 12.7], error="cancelled"),  # bin 2, failed
        make_request(12.9, [13.0, 13.2]),  # bin 2, attains
        make_request(9.0, [9.1]),  # before the window
    ]
    bins = slo_attainment_bins(records, Window(10.0, 13.5), slo_ttft_s=1.0, slo_tpot_s=0.5)
    assert [b.start_s for b in bins] == [10.0, 11.0, 12.0, 13.0]
    assert [(b.num_requests, b.num_attained) for b in bins] == [(2, 1), (0, 0), (2, 1), (0, 0)]
    assert [b.attainment for b in bins] == [0.5, None, 0.5, None]


def test_latency_ratios_against_cold_restart_per_transition():
    events = [
        (EventKey("elastic", 2, 3), 2.0),
        (EventKey("cold_restart", 2, 3), 10.0),
        (EventKey("elastic", 3, 2), 1.0),
        (EventKey("cold_restart", 3, 2), None),  # failed: no reference for 3 -> 2
        (EventKey("extravagant", 2, 3), None),
    ]
    assert latency_ratios(events) == [pytest.approx(0.2), pytest.approx(1.0), None, None, None]


def test_transitions_plan_and_devices():
    assert parse_transitions("2-3,3-2") == [(2, 3), (3, 2)]
    assert parse_transitions("1-2-4") == [(1, 2), (2, 4)]
    for bad in ("2", "2-2", "0-1", "a-b"):
        with pytest.raises(ValueError):
            parse_transitions(bad)
    runs = plan_runs("all", [(2, 3), (3, 2)], (2, 3))
    assert [(r.strategy, r.from_dp, r.to_dp) for r in runs][:2] == [("elastic", 2, 3), ("elastic", 3, 2)]
    assert [r.strategy for r in runs[-4:]] == ["no_ipc_alloc", "no_p2p", "no_preinit", "no_zero_copy"]
    assert len(runs) == 4 * 2 + 4  # elastic 2->3 is shared by the strategy set and the ablation table
    assert devices_needed(runs) == 5  # extravagant 2 -> 3 on fresh devices
    assert [r.strategy for r in plan_runs("ablations", [(1, 2)], (2, 3))][0] == "elastic"
    assert devices_needed(plan_runs("elastic", [(1, 2), (2, 4)], (2, 3))) == 4
    pair = plan_runs("cold_restart,elastic", [(2, 3)], (2, 3))
    assert [r.strategy for r in pair] == ["elastic", "cold_restart"]  # in the table's order
    with pytest.raises(ValueError, match="--strategy"):
        plan_runs("elastic,warp", [(2, 3)], (2, 3))
