"""Expert offloading on the elastic server: a scale-down that needs it (tiny Qwen3-MoE, fp32, 2
devices of 1,750,000 B with a 1 MiB KV pool each).

At dp 2 = EP 2 a device holds its 4 experts resident; at dp 1 the 8 experts would need 1,807,872 B
(dense 366,080 + 8 x 49,152 + the KV pool), more than a device has, so without offloading the
scale is refused (`tests/unit/test_hmm_offload_layout.py`). With `--expert-cache-fraction 0.5`
each device has an expert cache of half its dp-2 experts (4 rows, 98,304 B) and its expert rows are
the host tier, and each scale starts the new caches with the experts the old instance used most:
streaming clients run back to back while the server scales 2 -> 1 -> 2; every
completion equals a single-process engine's, the devices stay within their budgets, the caches
and tiers show in /metrics and /admin/status, and no /dev/shm file outlives the server. Then, at
dp 2 (EP 2), LoRA adapters on the attention and on the (offloaded) experts register on every rank
and each answers like its merged model; two ESFT adapters through one
slot (their rows resident beside the caches, in the HMM's memory) each answer like their merged
model, swapped in turn.

Last, chaos on the same server (it has served adapters and scaled by then, as a production one
would have): kill -9 the device worker under rank 0 at dp 2 (the restored device gets a new cache
pool and reads its host tier from disk), and the old instance's rank while a scale 1 -> 2
prepares. Zero failed requests, every stream identical to the undisturbed run, /ready 200
again, an expert cache on every device and no /dev/shm file without a live owner (the harness
is `coordinator.bench.chaos_faults`, as in `test_chaos.py`)."""

from __future__ import annotations

import time

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
    client,
    clients_streaming,
    esft_adapters,
    greedy_completion,
    metric_values,
    reference_outputs,
    scale,
    wait_event,
)

from elasticmoe.tools.make_lora_adapter import make_lora_adapter, write_lora_merged_model
from hmm.memory import list_segments

pytestmark = pytest.mark.slow

BUDGET = 1_750_000


@pytest.fixture(scope="module")
def reference(tiny_model_dir) -> list[tuple[str, int]]:
    return reference_outputs(tiny_model_dir)


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    config = tiny_config(tiny_model_dir, dp=2, device_memory_bytes=BUDGET, kv_bytes_per_device=1 << 20,
                         expert_cache_fraction=0.5, offload_policy="lru", max_loras=1, max_lora_rank=4,
                         max_esft_adapters=1, max_esft_experts=2)
    with running(config) as srv:
        yield srv
    assert list_segments(config.shm_prefix) == [], "shared-memory files leaked"


def test_a_scale_down_that_needs_offloading_serves_exact_tokens_under_load(server, reference):
    with clients_streaming(server, 2) as results, client(server) as c:
        status = c.get("/admin/status").json()
        assert [r["capacity_experts"] for r in status["expert_cache"]] == [4, 4]  # half of 2 layers x 4 experts
        down = wait_event(c, scale(c, 1))
        assert down["state"] == "succeeded", down
        assert 1 <= down["expert_rows_warmed"] <= 4  # the old instance's most used experts first
        status = c.get("/admin/status").json()
        assert [r["capacity_experts"] for r in status["expert_cache"]] == [4]  # now of 2 layers x 8
        up = wait_event(c, scale(c, 2))
        assert up["state"] == "succeeded", up
        assert 1 <= up["expert_rows_warmed"] <= 8
        assert up["expert_load_imbalance"] >= 1.0  # the placement was balanced by the tokens routed
    assert len(results) >= 2
    for i, got in results:
        assert got == reference[i], f"prompt {PROMPTS[i]} differs from the single-process engine"
    with client(server) as c:
        status = c.get("/admin/status").json()
        metrics = c.get("/metrics").text
    assert status["active_config"]["dp"] == 2
    assert all(d["peak_bytes"] <= d["budget_bytes"] for d in status["devices"] if d["peak_bytes"] is not None)
    assert sum(metric_values(metrics, 'elasticmoe_expert_loads_total{kind="on_demand"}')) > 0
    assert sum(metric_values(metrics, 'elasticmoe_expert_bytes_loaded_total{tier="host"}')) > 0
    assert len(metric_values(metrics, 'elasticmoe_device_memory_layout_bytes{device="0",kind="host_experts"}')) == 1
    assert metric_values(metrics, 'elasticmoe_device_memory_layout_bytes{device="0",kind="expert_cache"}') == [98304.0]


def test_lora_on_an_offloading_server_equals_its_merged_models(server, reference, tiny_model_dir, tmp_path):
    adapters = {"attn": make_lora_adapter(tiny_model_dir, str(tmp_path / "attn"), rank=4,
                                          target_modules=("q_proj", "v_proj"), seed=1),
                "experts": make_lora_adapter(tiny_model_dir, str(tmp_path / "experts"), rank=4,
                                             target_modules=("gate_proj", "down_proj"), seed=2)}
    want = {name: reference_outputs(str(write_lora_merged_model(tiny_model_dir, path, str(tmp_path / f"{name}-m"))))
            for name, path in adapters.items()}
    assert all(w[:2] != reference[:2] for w in want.values())  # the adapters change the text
    with client(server) as c:
        assert c.get("/admin/status").json()["active_config"]["dp"] == 2  # EP 2: every rank loads its share
        for name, path in adapters.items():  # one at a time: the server's host cache holds one LoRA adapter
            r = c.post("/admin/adapters", json={"name": name, "path": str(path)})
            assert r.status_code == 201, r.text
            for i in range(2):
                assert greedy_completion(c, name, PROMPTS[i]) == want[name][i], name
            assert c.delete(f"/admin/adapters/{name}").status_code in (200, 202)
            deadline = time.monotonic() + 30  # released on every rank in the background
            while any(a["name"] == name for a in c.get("/admin/adapters").json()["adapters"]):
                assert time.monotonic() < deadline, f"{name} was not unloaded"
                time.sleep(0.05)


def test_esft_adapters_on_an_offloading_server_equal_their_merged_models(server, reference, tiny_model_dir, tmp_path):
    adapters, want = esft_adapters(tiny_model_dir, tmp_path)
    assert all(w[:2] != reference[:2] for w in want.values())  # the adapters change the text
    with client(server) as c:
        assert c.get("/admin/status").json()["active_config"]["dp"] == 2  # EP 2: each rank holds its experts' rows
        check_esft_swaps(c, adapters, want)  # one slot: each request swaps its adapter in


@pytest.fixture(scope="module")
def undisturbed_streams(server) -> list[str]:
    return reference_streams(server, 2)


@pytest.mark.parametrize("fault,dp", OFFLOAD_FAULTS, ids=OFFLOAD_FAULT_IDS)
def test_a_killed_process_of_an_offloading_server_costs_no_request(server, undisturbed_streams, fault, dp):
    assert_an_offloading_server_loses_nothing(server, undisturbed_streams, fault, dp)
