"""Elastic scaling over HTTP: DP1 -> 2 -> 3 -> 2 -> 1 under streaming load (tiny Qwen3-MoE) while
Ray nodes join.

One Ray cluster per module (`ray start --head` and `ray start --address`, each node offering one
device, token authentication on, `tests/ray_nodes.py`) and the server on it (`elasticmoe serve
--address`): the walk scales onto the second node's device; then a third node joins while
serving, its device is registered without a restart, and the walk scales onto it and back. Every device worker and rank
runs on its device's node, and weights cross nodes by p2p (gloo), counted. Four clients keep streaming greedy
completions back to back while `POST /admin/scale` walks the server through dp 1, 2, 3,
2, 1; every one of those requests completes with exactly the text and token count of a
single-process `LLMEngine` run of the same prompt (no failed request, no repeated or
skipped delta), and requests are handed over at the switchovers.
Also: bad scale requests are 400s naming "dp" or "strategy", a second scale while one
runs is a 409, an unknown event id is a 404. Teardown must leave no /dev/shm file behind.
"""

from __future__ import annotations

import json
import secrets
import socket
import subprocess
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import torch
from ray_nodes import RayNodes, Served, ray_nodes, serve_on

from elasticmoe.config import EngineConfig
from elasticmoe.engine.llm_engine import LLMEngine
from elasticmoe.sampling_params import SamplingParams
from hmm.memory import list_segments

pytestmark = pytest.mark.slow

MODEL = "tiny-qwen3-moe"
PROMPTS = [[5, 6, 7, 8, 9, 10], [11, 12, 13], [20, 21, 22, 23], [30, 31]]
MAX_TOKENS = 200  # clients stream back to back, so some request is mid-flight at every switchover
WALK = [2, 3, 2, 1]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def reference(tiny_model_dir) -> list[tuple[str, int]]:
    """(text, num_output_tokens) per prompt, single process, float32, greedy."""
    engine = LLMEngine(
        EngineConfig(model=tiny_model_dir, dtype=torch.float32, num_kv_blocks=1024, num_threads=1)
    )
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(f"ref-{i}", prompt, params)
    final = {}
    while engine.has_unfinished_requests():
        final.update({o.request_id: o for o in engine.step() if o.finished})
    return [(final[f"ref-{i}"].text, len(final[f"ref-{i}"].output_token_ids)) for i in range(len(PROMPTS))]


@pytest.fixture(scope="module")
def served(tiny_model_dir, reference):
    prefix = f"emoetest{secrets.token_hex(4)}"
    with ray_nodes(head_devices=1, worker_devices=(1,)) as nodes:
        with serve_on(nodes, "--model", tiny_model_dir, "--served-model-name", MODEL, "--dtype", "float32",
                      "--device-memory-gb", str(64 / 1024), "--kv-cache-gb", str(8 / 1024),
                      "--shm-prefix", prefix) as srv:
            yield srv, nodes
        assert _actor_processes() == [], "a device worker or rank outlived the server"
    assert list_segments(prefix) == [], "shared-memory files leaked"


@pytest.fixture(scope="module")
def server(served) -> Served:
    return served[0]


def _actor_processes() -> list[str]:
    out = subprocess.run(["pgrep", "-af", "ray::DeviceWorker|ray::InstanceRank"], capture_output=True, text=True)
    return out.stdout.splitlines()


def _check_placement(status: dict) -> set[str]:
    """Every device worker and rank runs on its device's Ray node; the nodes of the ranks."""
    node_of = {d["device_id"]: d["ray_node_id"] for d in status["devices"]}
    assert len(set(node_of.values())) == len(node_of), status["devices"]  # one device per node
    assert all(d["running_on"] == d["ray_node_id"] for d in status["devices"]), status["devices"]
    ranks = status["instance"]["ranks"]
    assert all(r["running_on"] == r["ray_node_id"] == node_of[r["device_id"]] for r in ranks), ranks
    return {r["running_on"] for r in ranks}


def _client(server: Served) -> httpx.Client:
    return httpx.Client(base_url=server.url, timeout=120)


def _stream(server: Served, prompt: list[int]) -> tuple[str, int]:
    """(streamed text, completion_tokens) of one streaming greedy completion."""
    body = {
        "model": MODEL,
        "prompt": prompt,
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    text, usage = [], None
    with _client(server) as c, c.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[len("data: ") :])
            assert "error" not in chunk, chunk  # a failed request
            if chunk.get("usage"):
                usage = chunk["usage"]
            text += [c["text"] for c in chunk["choices"]]
    assert usage is not None
    return "".join(text), usage["completion_tokens"]


def _client_loop(server: Served, first: int, stop: threading.Event) -> list[tuple[int, tuple[str, int]]]:
    """Stream back to back (cycling through the prompts) until `stop`; (prompt index, result) each."""
    results, i = [], first
    while not stop.is_set():
        results.append((i, _stream(server, PROMPTS[i])))
        i = (i + 1) % len(PROMPTS)
    return results


def _scale(c: httpx.Client, dp: int) -> str:
    r = c.post("/admin/scale", json={"dp": dp})
    assert r.status_code == 202, r.text
    return str(r.json()["event_id"])


def _wait_event(c: httpx.Client, event_id: str, timeout_s: float = 120) -> dict:
    deadline = time.monotonic() + timeout_s
    while (event := c.get(f"/admin/scale/{event_id}").json())["state"] == "running":
        assert time.monotonic() < deadline, event
        time.sleep(0.05)
    return event


def _join_node(c: httpx.Client, nodes: RayNodes, timeout_s: float = 60) -> dict:
    """A node joins the Ray cluster; wait until the server registered its device."""
    before = len(c.get("/admin/devices").json()["devices"])
    nodes.add_node(devices=1)
    deadline = time.monotonic() + timeout_s
    # NOTE: a device is listed once registered, and answers once the p2p group is rebuilt
    while len((report := c.get("/admin/devices").json())["devices"]) == before or any(
            d["state"] != "alive" for d in report["devices"]):
        assert time.monotonic() < deadline, report
        time.sleep(0.2)
    return report


def test_streams_survive_scaling_1_2_3_2_1(served, reference):
    server, nodes = served
    stop = threading.Event()
    events, rank_nodes = [], []
    with ThreadPoolExecutor(len(PROMPTS)) as pool, _client(server) as c:
        futures = [pool.submit(_client_loop, server, i, stop) for i in range(len(PROMPTS))]
        try:
            time.sleep(1.0)  # every client is mid-stream
            for step, dp in enumerate(WALK):
                event_id = _scale(c, dp)
                if step == 0:
                    conflict = c.post("/admin/scale", json={"dp": 2})  # valid, but the first one still runs
                    assert conflict.status_code == 409, conflict.text
                    assert conflict.json()["error"]["param"] == "dp"
                events.append(_wait_event(c, event_id))
                assert events[-1]["state"] == "succeeded", events[-1]
                status = c.get("/admin/status").json()
                assert status["active_config"]["dp"] == dp
                rank_nodes.append(_check_placement(status))
                if step == 0:  # dp 2 fills both nodes: a third joins, and the next scale uses it
                    joined = _join_node(c, nodes)
                    assert len(joined["nodes"]) == 3 and len(joined["devices"]) == 3
                    assert c.post("/admin/scale", json={"dp": 4}).status_code == 400  # 3 devices, no more
                time.sleep(0.5)  # streams progress on the new instance before the next scale
        finally:
            stop.set()
        status = c.get("/admin/status").json()
        results = [r for f in futures for r in f.result(timeout=300)]

    assert status["active_config"]["dp"] == 1 and status["instance"]["state"] == "active"
    # Same text and token count as without scaling; no request failed (a failure raises above).
    assert [res for _, res in results] == [reference[i] for i, _ in results]
    assert len(results) >= 2 * len(PROMPTS)
    # Every request in flight at a switchover is handed over, and the walk had some in flight.
    assert all(e["requests_handed_over"] == e["requests_in_flight"] for e in events)
    assert sum(e["requests_handed_over"] for e in events) > 0
    # The walk ran on both nodes; what crossed them went by p2p, never through the driver.
    assert [len(n) for n in rank_nodes] == [2, 3, 2, 1]
    assert sum(e["bytes_moved"]["bytes_p2p_gloo"] for e in events) > 0, [e["bytes_moved"] for e in events]
    for event in events:
        assert 0 < event["downtime_s"] < event["scale_latency_s"] and event["peak_memory_bytes"] > 0
        print(
            f"\nscale dp {event['from_dp']}->{event['to_dp']}: latency {event['scale_latency_s']:.2f}s, "
            f"critical section {event['downtime_s'] * 1e3:.0f} ms, peak {event['peak_memory_bytes'] / 2**20:.1f} "
            f"MiB, handed over {event['requests_handed_over']}/{event['requests_in_flight']}, "
            f"bytes {event['bytes_moved']}"
        )
    with _client(server) as c:
        assert c.get("/health").status_code == 200
        r = c.post("/v1/completions", json={"model": MODEL, "prompt": PROMPTS[0], "max_tokens": 4})
        assert r.status_code == 200, r.text
        metrics = c.get("/metrics").text
        assert 'elasticmoe_scale_events_total{outcome="succeeded",strategy="elastic"} 4.0' in metrics


@pytest.mark.parametrize("body", [{"dp": 0}, {"dp": 99}, {"dp": "two"}, {"dp": 1.5}, {"dp": 1}, {}])
def test_bad_scale_request_is_400_naming_dp(server, body):
    with _client(server) as c:
        r = c.post("/admin/scale", json=body)
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["param"] == "dp" and error["message"], error
        assert c.get("/admin/status").json()["scale_event"] is None


def test_unknown_strategy_is_400_naming_strategy(server):
    with _client(server) as c:
        r = c.post("/admin/scale", json={"dp": 2, "strategy": "warp"})
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == "strategy"
        assert c.get("/admin/status").json()["scale_event"] is None


def test_unknown_scale_event_is_404(server):
    with _client(server) as c:
        r = c.get("/admin/scale/scale-999")
        assert r.status_code == 404 and r.json()["error"]["type"]
