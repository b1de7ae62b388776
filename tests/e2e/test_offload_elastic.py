"""Expert offloading on the elastic server (tiny Qwen3-MoE, 2 devices, dp 2 = EP 2, a quarter of
each rank's experts cached): streaming clients run back to back while the server scales 2 -> 1;
every completion equals a single-process engine's (the ranks load experts from the node's host
copy on demand), the caches show in /metrics and /admin/status, and no /dev/shm file outlives the
server."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
from elastic_server import running, tiny_config
from streaming_clients import PROMPTS, client, client_loop, reference_outputs, scale, wait_event

from hmm.memory import list_segments

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def reference(tiny_model_dir) -> list[tuple[str, int]]:
    return reference_outputs(tiny_model_dir)


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    config = tiny_config(tiny_model_dir, dp=2, expert_cache_fraction=0.25, offload_policy="lru")
    with running(config) as srv:
        yield srv
    assert list_segments(config.shm_prefix) == [], "shared-memory files leaked"


def test_offloading_ranks_serve_exact_tokens_across_a_scale_down(server, reference):
    stop = threading.Event()
    with ThreadPoolExecutor(2) as pool:
        loops = [pool.submit(client_loop, server, i, stop) for i in range(2)]
        with client(server) as c:
            status = c.get("/admin/status").json()
            assert [r["capacity_experts"] for r in status["expert_cache"]] == [2, 2]  # 25% of 2 layers x 4
            event = wait_event(c, scale(c, 1))
            assert event["state"] == "succeeded", event
            stop.set()
        results = [r for f in loops for r in f.result(timeout=300)]
    assert len(results) >= 2
    for i, got in results:
        assert got == reference[i], f"prompt {PROMPTS[i]} differs from the single-process engine"
    with client(server) as c:
        status = c.get("/admin/status").json()
        metrics = c.get("/metrics").text
    assert status["active_config"]["dp"] == 1 and len(status["expert_cache"]) == 1
    assert status["expert_cache"][0]["capacity_experts"] == 4  # 25% of 2 layers x 8
    on_demand = [line for line in metrics.splitlines() if line.startswith('elasticmoe_expert_loads_total{kind="on_demand"}')]
    assert on_demand and float(on_demand[0].split()[-1]) > 0
    host = [line for line in metrics.splitlines() if line.startswith('elasticmoe_expert_bytes_loaded_total{tier="host"}')]
    assert host and float(host[0].split()[-1]) > 0
