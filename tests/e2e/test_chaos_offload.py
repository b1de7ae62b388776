"""Chaos with expert offloading: kill -9 a device worker, and the old instance's rank in the
middle of a scale, of an elastic server whose devices hold an expert cache and whose experts are
the host tier, or only in the checkpoint (`--expert-tier disk`) (tiny Qwen3-MoE, 3 logical
devices, float32, half of each device's experts cached). The restored device gets a new cache
pool and reads its host tier from disk (with the disk tier: nothing but its dense weights); the
scale's new caches are warmed as usual. Zero failed requests, every stream identical to the
undisturbed run, /ready 200 again and no /dev/shm file without a live owner. The harness is
`coordinator.bench.chaos_faults` (as in `test_chaos.py`)."""

from __future__ import annotations

import httpx
import pytest
from chaos_runs import MODEL, inject, reference_streams
from elastic_server import running, tiny_config

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module", params=["host", "disk"], ids=["host-tier", "disk-tier"])
def server(tiny_model_dir, request):
    config = tiny_config(tiny_model_dir, num_devices=3, dp=2, served_model_name=MODEL, expert_cache_fraction=0.5,
                         offload_policy="lru", expert_tier=request.param)
    with running(config) as srv:
        yield srv


@pytest.fixture(scope="module")
def reference(server):
    return reference_streams(server, 2)


@pytest.mark.parametrize("fault,dp", [("device", 2), ("mid-scale", 1)], ids=["device-worker", "old-rank-mid-scale"])
def test_a_killed_process_of_an_offloading_server_costs_no_request(server, reference, fault, dp):
    r = inject(server, reference, fault, dp)
    assert (r.failed, r.identical) == (0, r.requests), r.errors
    assert r.recover_s is not None and r.events, "the repair left no event"
    assert r.orphaned_shm_files == 0
    with httpx.Client(base_url=server.url) as c:
        assert c.get("/ready").status_code == 200
        status = c.get("/admin/status").json()
    assert status["expert_cache"] and all(r["capacity_experts"] > 0 for r in status["expert_cache"])
