"""The scaling benchmark end to end: `python -m coordinator.bench.scaling` on the tiny model.

Elastic and cold restart, DP2 -> 3 under Poisson load with short windows. The JSON on
stdout must be the only thing there, carry every per-event figure, show no failed
request and elastic's latency as a ratio of cold restart's, and the SLO plot must be
a PNG. No /dev/shm file may outlive it.
"""

from __future__ import annotations

import json
import os
import re
import sys

import pytest
from bench_runs import run_bench

pytestmark = pytest.mark.slow

EVENT_FIELDS = {
    "strategy", "from_dp", "to_dp", "event_id", "state", "http_status", "strategy_applied", "strategy_ignored", "error",
    "scale_latency_s", "downtime_s", "client_downtime_s", "baseline_client_downtime_s", "event_window_s",
    "baseline_window_s", "peak_memory_bytes", "requests_in_flight", "requests_handed_over", "failed_requests",
    "failed_requests_total", "num_requests", "throughput_tok_s", "latency_ratio_vs_cold_restart", "post_s",
    "finished_s", "slo_bins", "expert_rows_warmed", "expert_load_imbalance",
}


def _bench_segments() -> set[str]:
    return {n for n in os.listdir("/dev/shm") if n.startswith("emoescaling")}


def test_scaling_bench_elastic_on_tiny_model(tiny_model_dir, tmp_path):
    before = _bench_segments()
    plot, out = tmp_path / "scaling.png", tmp_path / "scaling.json"
    # 4 req/s: with 2 s windows and requests shorter than a second, no arrival in the after-window
    # (no token there) has a chance of e^-8; at 2 req/s it was e^-4, ~2% of runs.
    cmd = [sys.executable, "-m", "coordinator.bench.scaling", "--preset", "tiny", "--model", tiny_model_dir,
           "--dtype", "float32", "--strategy", "elastic", "--transitions", "2-3", "--rps", "4",
           "--warmup-s", "3", "--window-s", "2", "--during-s", "2", "--max-tokens", "8-16", "--prompt-len", "16",
           "--json", "--out", str(out), "--plot", str(plot)]
    proc = run_bench(cmd, timeout_s=400)
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = json.loads(proc.stdout)  # nothing but the JSON document on stdout
    assert json.loads(out.read_text()) == doc

    events = doc["events"]
    # NOTE: elastic only: cold restart is the scaler's tests' (tests/integration/test_scaler.py), the
    # ratio to it the metrics' unit tests' (tests/unit/test_bench_scale_metrics.py).
    assert [(e["strategy"], e["from_dp"], e["to_dp"]) for e in events] == [("elastic", 2, 3)]
    for e in events:
        assert EVENT_FIELDS <= e.keys()
        assert e["state"] == "succeeded" and e["http_status"] == 202 and not e["strategy_ignored"], e
        assert e["failed_requests"] == 0 and e["failed_requests_total"] == 0 and e["num_requests"] > 0, e
        assert 0 <= e["downtime_s"] <= e["scale_latency_s"] and e["peak_memory_bytes"] > 0, e
        assert 0 <= e["client_downtime_s"] <= e["event_window_s"]
        assert 0 <= e["baseline_client_downtime_s"] <= e["baseline_window_s"]
        assert set(e["throughput_tok_s"]) == {"before", "during", "after"}
        assert e["throughput_tok_s"]["after"] > 0, e  # "before" may be 0 if the first TTFT is slow
        assert sum(b["num_requests"] for b in e["slo_bins"]) > 0
    assert events[0]["latency_ratio_vs_cold_restart"] is None  # no cold restart ran to compare with
    assert doc["ablation"] == []
    assert re.search(r"^elastic\s+2->3\s+succeeded", proc.stderr, re.M)  # the human table
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert _bench_segments() <= before, "shared-memory files leaked"
