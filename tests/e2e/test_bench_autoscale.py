"""The SLO benchmark end to end: `python -m coordinator.bench.autoscale` on the tiny model.

Elastic with short phases (cold restart runs through the same code, a strategy name apart;
the scaler's tests cover its event). The JSON on stdout must be the only thing
there and carry the calibration, both Fig. 9 runs per strategy (with their scale events
succeeded) and the Fig. 10 levels; the plot must be a PNG; no /dev/shm file of the
benchmark may outlive it.
"""

from __future__ import annotations

import json
import os
import sys

import pytest
from bench_runs import run_bench

pytestmark = pytest.mark.slow


def _segments() -> set[str]:
    return {n for n in os.listdir("/dev/shm") if n.startswith("emoeauto")}


def test_autoscale_bench_on_tiny_model(tiny_model_dir, tmp_path):
    before = _segments()
    plot = tmp_path / "autoscale.png"
    cmd = [sys.executable, "-m", "coordinator.bench.autoscale", "--preset", "tiny", "--model", tiny_model_dir,
           "--dtype", "float32", "--strategies", "elastic", "--levels", "0.1", "--run-s", "3",
           "--level-s", "3", "--pre-s", "2", "--command-delay-s", "1", "--command-at-s", "2",
           "--calibration-requests", "8", "--prompt-len", "uniform:16:32", "--output-len", "8", "--standby-delay-s", "0",
           # NOTE: low rates: the runs check the plumbing, and at the calibrated rates (~40-90 rps
           # of tiny requests) the load alone kept both cores busy for the whole test
           "--low-rps", "4", "--high-rps", "8", "--json",
           "--plot", str(plot)]
    proc = run_bench(cmd, timeout_s=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = json.loads(proc.stdout)
    assert doc["capacity_rps"]["dp1"] > 0 and doc["capacity_rps"]["dp2"] > 0
    assert doc["low_rps"] < doc["high_rps"]
    for kind, (a, b) in (("scale_up", (1, 2)), ("scale_down", (2, 1))):
        runs = doc[kind]
        assert [(r["strategy"], r["from_dp"], r["to_dp"]) for r in runs] == [("elastic", a, b)]
        for r in runs:
            assert r["event"]["state"] == "succeeded", r["event"]
            assert 0 <= r["attainment"] <= 1 and r["num_requests"] > 0
            assert sum(x["num_requests"] for x in r["bins"]) == r["num_requests"]
            assert r["device_seconds"] > 0
    levels = [(r["level"], r["strategy"]) for r in doc["slo_vs_rps"]]
    assert levels == [(0.1, "elastic")]
    assert "| scale-up dp 1->2 | elastic |" in proc.stderr  # the table
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert _segments() == before
