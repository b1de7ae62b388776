"""Expert offloading from the disk tier on the elastic server (`--expert-tier disk`): the experts a
device's cache does not hold are read from the checkpoint, never held in memory, not even in the
OS page cache (`--expert-page-cache drop`; tiny Qwen3-MoE, fp32, the devices of
`test_offload_elastic.py`: 1,750,000 B, a 1 MiB KV pool, a cache of half a device's dp-2 experts).

Streaming clients run back to back while the server scales 2 -> 1 -> 2: every completion equals a
single-process engine's, the caches load from disk only, no device holds an expert row in host
memory, and no scale moves one (a scale-down moves nothing; a scale-up moves the new device's dense
weights). Then two ESFT adapters through one slot each answer like their merged model, also after
a scale 2 -> 1 -> 2: their rows are the only expert rows the host tier holds. Last, the two kills
of `test_offload_elastic.py` on this server (the restored device gets its dense weights and a
new cache pool): zero failed requests, identical streams."""

from __future__ import annotations

import pytest
from chaos_runs import (
    OFFLOAD_FAULT_IDS,
    OFFLOAD_FAULTS,
    assert_an_offloading_server_loses_nothing,
    reference_streams,
)
from elastic_server import running, tiny_config
from streaming_clients import (
    PROMPTS,
    check_esft_swaps,
    check_swap_for_a_client_that_left,
    client,
    clients_streaming,
    esft_adapters,
    greedy_completion,
    metric_values,
    reference_outputs,
    scale,
    wait_event,
)

from elasticmoe.config import ModelConfig
from hmm.layout import ModelSizes

pytestmark = pytest.mark.slow

BUDGET = 1_750_000
EXPERT_ROW = 49_152  # bytes of one (layer, expert) of the tiny model in fp32: w13 + w2


@pytest.fixture(scope="module")
def reference(tiny_model_dir) -> list[tuple[str, int]]:
    return reference_outputs(tiny_model_dir)


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    config = tiny_config(tiny_model_dir, dp=2, device_memory_bytes=BUDGET, kv_bytes_per_device=1 << 20,
                         expert_cache_fraction=0.5, offload_policy="lru", expert_tier="disk",
                         expert_page_cache="drop", max_esft_adapters=1, max_esft_experts=2)
    with running(config) as srv:
        yield srv


def test_a_disk_tier_server_scales_under_load_with_exact_tokens_and_no_expert_in_memory(server, reference,
                                                                                        tiny_model_dir):
    with clients_streaming(server, 2) as results, client(server) as c:
        down = wait_event(c, scale(c, 1))
        assert down["state"] == "succeeded", down
        up = wait_event(c, scale(c, 2))
        assert up["state"] == "succeeded", up
    with client(server) as c:
        status = c.get("/admin/status").json()
        metrics = c.get("/metrics").text
    assert len(results) >= 2
    for i, got in results:
        assert got == reference[i], f"prompt {PROMPTS[i]} differs from the single-process engine"
    assert status["active_config"]["dp"] == 2
    assert [r["capacity_experts"] for r in status["expert_cache"]] == [4, 4]
    assert status["offload"] == {"policy": "lru", "prefetch_distance": 1, "expert_tier": "disk", "expert_page_cache": "drop"}
    assert all(r["bytes_loaded_host"] == 0 for r in status["expert_cache"])
    assert sum(r["bytes_loaded_disk"] for r in status["expert_cache"]) >= EXPERT_ROW
    assert all(d["peak_bytes"] <= d["budget_bytes"] for d in status["devices"] if d["peak_bytes"] is not None)
    assert sum(metric_values(metrics, 'elasticmoe_expert_bytes_loaded_total{tier="disk"}')) >= EXPERT_ROW
    assert sum(metric_values(metrics, 'elasticmoe_expert_bytes_loaded_total{tier="host"}')) == 0
    for device in (0, 1):
        host = metric_values(metrics, f'elasticmoe_device_memory_layout_bytes{{device="{device}",kind="host_experts"}}')
        assert sum(host) == 0, host
    # No scale moved an expert: nothing is held to move. The scale-down moves nothing at all; the
    # scale-up copies the new device's dense tensors only.
    assert sum(down["bytes_moved"].values()) == 0, down
    dense = ModelSizes.from_model(ModelConfig.from_pretrained(tiny_model_dir), 4).dense_bytes
    assert sum(up["bytes_moved"].values()) == dense, up


def test_esft_adapters_on_a_disk_tier_server_equal_their_merged_models(server, reference, tiny_model_dir, tmp_path):
    adapters, want = esft_adapters(tiny_model_dir, tmp_path)
    assert all(w[:2] != reference[:2] for w in want.values())  # the adapters change the text
    with client(server) as c:
        assert c.get("/admin/status").json()["active_config"]["dp"] == 2
        check_esft_swaps(c, adapters, want)  # one slot: each request swaps its adapter in
        check_swap_for_a_client_that_left(c, "alpha", "beta", want)  # alpha is the one resident now
        for dp in (1, 2):  # the adapters' rows move with their experts; the base experts stay on disk
            assert wait_event(c, scale(c, dp))["state"] == "succeeded"
            assert greedy_completion(c, "alpha", PROMPTS[0]) == want["alpha"][0]
        metrics = c.get("/metrics").text
    adapters_held = sum(metric_values(metrics, 'elasticmoe_device_memory_layout_bytes{device="0",kind="adapters"}'))
    assert adapters_held > 0  # the resident adapter's rows: what the host tier holds
    assert sum(metric_values(metrics, 'elasticmoe_expert_bytes_loaded_total{tier="host"}')) == 0


@pytest.fixture(scope="module")
def undisturbed_streams(server) -> list[str]:
    return reference_streams(server, 2)


@pytest.mark.parametrize("fault,dp", OFFLOAD_FAULTS, ids=OFFLOAD_FAULT_IDS)
def test_a_killed_process_of_a_disk_tier_server_costs_no_request(server, undisturbed_streams, fault, dp):
    assert_an_offloading_server_loses_nothing(server, undisturbed_streams, fault, dp)
