"""The CoServe benchmark end to end: `python -m coordinator.bench.coserve` on the tiny model.

Six LoRA adapters through two slots and three ESFT adapters through one, CoServe at dp 1 and
the resident baseline (a slot for every adapter the load uses), a few seconds of Poisson load:
the JSON on stdout is the only thing there and has every figure of both tables, no request
failed, CoServe switched adapters and the resident run none (server counters), the plot is a
PNG, and no /dev/shm file outlives it. (LRU+FCFS, FIFO and parallel differ from CoServe only in
the policies they name, which the policies' unit tests cover.)
"""

from __future__ import annotations

import json
import os
import sys

import pytest
from bench_runs import run_bench

pytestmark = pytest.mark.slow

RUN_FIELDS = {
    "config", "dp", "eviction", "arranging", "assigning", "register_s", "num_registered", "num_requests", "failed",
    "throughput_tok_s", "ttft_s", "tpot_s", "hot_ttft_s", "switches", "hit_rate", "counters", "breakdown_s",
    "arrived_resident_ttft_s", "num_arrived_resident", "swapped_ttft_s", "num_swapped", "arrived_resident_vs_resident",
}


def _bench_segments() -> set[str]:
    return {n for n in os.listdir("/dev/shm") if n.startswith("emoecoserve")}


def test_coserve_bench_on_tiny_model(tiny_model_dir, tmp_path):
    before = _bench_segments()
    plot, out = tmp_path / "coserve.png", tmp_path / "coserve.json"
    cmd = [sys.executable, "-m", "coordinator.bench.coserve", "--preset", "tiny", "--model", tiny_model_dir,
           "--num-lora", "6", "--num-esft", "3", "--max-loras", "2", "--max-esft-adapters", "1",
           "--lora-target-modules", "q_proj,v_proj",
           "--esft-experts", "2", "--lora-rank", "4", "--configs", "coserve,resident", "--dps", "1", "--rps", "3",
           "--duration-s", "3", "--max-tokens", "8", "--prompt-len", "8", "--base-share", "0.05",
           "--cache-dir", str(tmp_path / "adapters"), "--json", "--out", str(out), "--plot", str(plot)]
    proc = run_bench(cmd, timeout_s=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = json.loads(proc.stdout)  # nothing but the JSON document on stdout
    assert json.loads(out.read_text()) == doc
    assert doc["num_adapters"] == {"lora": 6, "esft": 3} and doc["num_requests"] > 0
    assert doc["config"]["lora_target_modules"] == "q_proj,v_proj"  # the ranks' slots hold the adapters' modules only

    runs = doc["runs"]
    assert [(r["config"], r["dp"]) for r in runs] == [("coserve", 1), ("resident", 1)]
    for r in runs:
        assert RUN_FIELDS <= r.keys(), sorted(RUN_FIELDS - r.keys())
        assert r["failed"] == 0 and r["num_requests"] == doc["num_requests"], r.get("errors")
        assert r["throughput_tok_s"] > 0 and r["breakdown_s"]["assigning"] > 0  # every request was assigned a rank
    coserve, resident = runs
    assert coserve["num_registered"] == 9 and (coserve["max_loras"], coserve["max_esft_adapters"]) == (2, 1)
    assert coserve["switches"] > 0 and 0 <= coserve["hit_rate"] <= 1, coserve["counters"]
    assert coserve["counters"]["esft_swaps_in"] > 0 and coserve["breakdown_s"]["management_esft"] > 0
    # The resident run: only the adapters the load asks for, each in its own slot from registration on.
    used = resident["num_registered"]
    assert 2 < used <= 9 and resident["max_loras"] + resident["max_esft_adapters"] >= used
    assert resident["switches"] == 0 and resident["hit_rate"] == 1.0, resident["counters"]
    # The server's adapter-state header: in the resident run every adapter request found its adapter
    # resident; CoServe's swaps made some wait (a LoRA miss at the rank, or an ESFT swap at the ingress).
    assert resident["num_swapped"] == 0 and resident["num_arrived_resident"] > 0
    assert coserve["num_swapped"] > 0 and coserve["swapped_ttft_s"]["p99"] > 0
    assert coserve["num_arrived_resident"] + coserve["num_swapped"] == resident["num_arrived_resident"]
    assert coserve["arrived_resident_vs_resident"] is None or coserve["arrived_resident_vs_resident"] > 0
    assert "Fig. 13" in proc.stderr and "Fig. 15" in proc.stderr and "hot vs resident" in proc.stderr
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert _bench_segments() <= before, "the bench left shared-memory files behind"
