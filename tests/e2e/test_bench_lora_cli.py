"""The LoRA benchmark end to end: `python -m elasticmoe.bench.lora` on the tiny model.

Small sizes of all three phases. The JSON on stdout must be the only thing there, and its
figures sane: per-token routing serves each sequence once, per-sequence K times; positive
times and finite ratios; with 4 adapters over 2 slots (and 1, the paging baseline) adapters
are swapped in and evicted, and the hit rate is a rate.
"""

from __future__ import annotations

import json
import math
import sys

import pytest
from bench_runs import run_bench

pytestmark = pytest.mark.slow


def _positive(v) -> bool:
    return v is not None and math.isfinite(v) and v > 0


@pytest.mark.parametrize("swap_flags", [[], ["--sync-swaps"]], ids=["engine-swaps", "sync-swaps"])
def test_lora_bench_on_tiny_model(tiny_model_dir, tmp_path, swap_flags):
    cmd = [sys.executable, "-m", "elasticmoe.bench.lora", "--preset", "tiny", "--model", tiny_model_dir,
           "--ks", "1,2,4", "--num-seqs", "3", "--num-adapters", "1,4", "--batch-size", "4",
           "--swap-adapters", "4", "--swap-slots", "2", "--swap-requests", "12", "--swap-concurrency", "3",
           "--input-len", "12", "--output-len", "4", "--repeats", "1",
           "--adapter-dir", str(tmp_path / "adapters"), "--json", *swap_flags]
    proc = run_bench(cmd, timeout_s=60)
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = json.loads(proc.stdout)  # nothing but the JSON document on stdout
    assert "per-token vs per-sequence" in proc.stderr and "hot-set swapping" in proc.stderr

    rows = doc["routing"]
    assert [r["k"] for r in rows] == [1, 2, 4]
    for r in rows:
        assert r["passes_per_token"] == r["num_seqs"] == 3
        assert r["passes_per_sequence"] == r["k"] * r["num_seqs"]
        assert len(r["adapters"]) == r["k"] and len(r["breaks"]) == r["k"] - 1
        assert _positive(r["per_token_s"]) and _positive(r["per_sequence_s"]) and _positive(r["speedup"])

    rows = doc["overhead"]
    assert [r["num_adapters"] for r in rows] == [0, 1, 4]
    assert rows[0]["decode_step_ratio"] == 1.0 and rows[0]["ttft_ratio"] == 1.0
    for r in rows:
        assert r["batch_size"] == 4
        for key in ("ttft_ms_p50", "decode_step_ms", "ttft_ratio", "decode_step_ratio"):
            assert _positive(r[key]), (key, r)

    sw = doc["swap"]
    assert isinstance(sw["async_swaps"], bool) and not (swap_flags and sw["async_swaps"])
    assert sw["num_adapters"] == 4 and sum(sw["requests_per_adapter"]) == sw["num_requests"] == 12
    by_slots = {r["slots"]: r for r in sw["rows"]}
    assert set(by_slots) == {1, 2} and by_slots[1]["is_paging_baseline"]
    for r in by_slots.values():
        assert r["swaps_in"] > 0 and r["evictions"] > 0, r  # more adapters than slots
        assert r["hits"] + r["misses"] > 0 and 0 <= r["hit_rate"] <= 1
        assert 0 < r["num_swap_steps"] <= r["num_steps"] and _positive(r["swap_step_ms"])
        # At S = 1 every prefill may also swap: then no prefill step without a swap exists.
        assert _positive(r["other_step_ms"]) and (r["prefill_step_ms"] is None or r["prefill_step_ms"] > 0)
        assert _positive(r["wall_s"]) and _positive(r["speedup_vs_paging"])
    assert by_slots[1]["speedup_vs_paging"] == 1.0
