"""Expert offloading from the disk tier on the elastic server (`--expert-tier disk`): the experts a
device's cache does not hold are read from the checkpoint, never held in memory (tiny Qwen3-MoE,
fp32, the devices of `test_offload_elastic.py`: 1,750,000 B, a 1 MiB KV pool, a cache of half a
device's dp-2 experts).

Streaming clients run back to back while the server scales 2 -> 1 -> 2: every completion equals a
single-process engine's, the caches load from disk only, no device holds an expert row in host
memory, and no scale moves one (a scale-down moves nothing; a scale-up moves the new device's dense
weights)."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
from elastic_server import running, tiny_config
from streaming_clients import PROMPTS, client, client_loop, reference_outputs, scale, wait_event

from elasticmoe.config import ModelConfig
from hmm.layout import ModelSizes

pytestmark = pytest.mark.slow

BUDGET = 1_750_000
EXPERT_ROW = 49_152  # bytes of one (layer, expert) of the tiny model in fp32: w13 + w2


def _metric(metrics: str, prefix: str) -> list[float]:
    return [float(line.split()[-1]) for line in metrics.splitlines() if line.startswith(prefix)]


def test_a_disk_tier_server_scales_under_load_with_exact_tokens_and_no_expert_in_memory(tiny_model_dir):
    reference = reference_outputs(tiny_model_dir)
    config = tiny_config(tiny_model_dir, dp=2, device_memory_bytes=BUDGET, kv_bytes_per_device=1 << 20,
                         expert_cache_fraction=0.5, offload_policy="lru", expert_tier="disk")
    assert config.esft_slots == (0, 0)  # ESFT slots need the host tier
    with running(config) as server:
        stop = threading.Event()
        with ThreadPoolExecutor(2) as pool:
            loops = [pool.submit(client_loop, server, i, stop) for i in range(2)]
            with client(server) as c:
                down = wait_event(c, scale(c, 1))
                assert down["state"] == "succeeded", down
                up = wait_event(c, scale(c, 2))
                assert up["state"] == "succeeded", up
                stop.set()
            results = [r for f in loops for r in f.result(timeout=300)]
        with client(server) as c:
            status = c.get("/admin/status").json()
            metrics = c.get("/metrics").text
    assert len(results) >= 2
    for i, got in results:
        assert got == reference[i], f"prompt {PROMPTS[i]} differs from the single-process engine"
    assert status["active_config"]["dp"] == 2
    assert [r["capacity_experts"] for r in status["expert_cache"]] == [4, 4]
    assert all(d["peak_bytes"] <= d["budget_bytes"] for d in status["devices"] if d["peak_bytes"] is not None)
    assert sum(_metric(metrics, 'elasticmoe_expert_bytes_loaded_total{tier="disk"}')) >= EXPERT_ROW
    assert sum(_metric(metrics, 'elasticmoe_expert_bytes_loaded_total{tier="host"}')) == 0
    for device in (0, 1):
        host = _metric(metrics, f'elasticmoe_device_memory_layout_bytes{{device="{device}",kind="host_experts"}}')
        assert sum(host) == 0, host
    # No scale moved an expert: nothing is held to move. The scale-down moves nothing at all; the
    # scale-up copies the new device's dense tensors only (less than one device's worth of experts).
    assert sum(down["bytes_moved"].values()) == 0, down
    dense = ModelSizes.from_model(ModelConfig.from_pretrained(tiny_model_dir), 4).dense_bytes
    assert sum(up["bytes_moved"].values()) == dense, up
