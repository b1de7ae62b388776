"""The ESFT benchmark end to end: `python -m elasticmoe.bench.esft` on the tiny model.

Two adapters from the real ESFT configs, a short Poisson workload per distribution,
memory rows and the rerouting microbenchmark. The JSON on stdout must be the only
thing there, and its figures sane: positive latencies, finite overhead ratios,
F_mem of ours <= padding, KV capacity of ours >= merged models.
"""

from __future__ import annotations

import json
import math
import sys

import pytest
from bench_runs import run_bench

pytestmark = pytest.mark.slow


def test_esft_bench_on_tiny_model(tiny_model_dir, tmp_path):
    cmd = [sys.executable, "-m", "elasticmoe.bench.esft", "--preset", "tiny", "--model", tiny_model_dir,
           "--num-adapters", "2", "--num-requests", "8", "--repeats", "1", "--tokens", "1,8", "--iters", "50",
           "--adapter-dir", str(tmp_path / "adapters"), "--json"]
    proc = run_bench(cmd, timeout_s=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = json.loads(proc.stdout)  # nothing but the JSON document on stdout
    assert "latency under load" in proc.stderr and "rerouting" in proc.stderr

    assert doc["adapters"]["configs"] == ["intent", "law", "summary", "translation"]
    e_max = doc["adapters"]["e_max"]
    assert e_max == max(max(per_layer.values()) for per_layer in doc["adapters"]["experts_per_layer"].values())

    rows = doc["latency"]
    assert [(r["num_adapters"], r["distribution"]) for r in rows] == [
        (2, "uniform"), (2, "power-0.3"), (2, "power-0.1")]
    for r in rows:
        for key in ("ttft_ms_p50", "ttft_ms_p90", "tpot_ms_p50", "tpot_ms_p90"):
            assert r[key] > 0 and r["base"][key] > 0, (key, r)
        for key in ("ttft_overhead_p50", "tpot_overhead_p50", "ttft_overhead_p90", "tpot_overhead_p90"):
            assert r[key] is not None and math.isfinite(r[key]) and r[key] > 0, (key, r)
        assert 0 < r["observed_top_share"] <= 1 and 0 < r["expected_top_share"] <= 1

    mem = doc["memory"]
    assert mem["kv_bytes_per_token"] > 0 and mem["page_size"] == 64 * 1024
    (m,) = mem["rows"]
    assert m["num_adapters"] == 2 and m["e_max"] == e_max
    assert m["base_bytes"] < m["needed_bytes"] <= m["ours_bytes"] <= m["padding_bytes"]
    assert m["merged_bytes"] == 2 * m["base_bytes"]
    assert 1 <= m["fmem_ours"] <= m["fmem_padding"]
    assert m["kv_tokens_ours"] >= m["kv_tokens_merged"] and m["kv_tokens_ours"] <= m["kv_tokens_base_only"]
    # The engine holds exactly the tuned experts the arithmetic calls needed.
    assert m["engine_adapter_bytes"] == m["needed_bytes"] - m["base_bytes"]

    rr = doc["reroute"]
    assert rr["num_adapters"] == 2 and [r["tokens"] for r in rr["rows"]] == [1, 8]
    for r in rr["rows"]:
        for key in ("fused_us", "singleop_us", "naive_us", "block_us", "block_fused_us"):
            assert r[key] > 0
        assert 0 < r["fused_share"] < 1 and r["naive_share"] > 0
