"""Capacity that comes and goes, over HTTP, on a real multi-node Ray cluster (tiny Qwen3-MoE).

The head offers no device, so the model lives on worker nodes only (as on KubeRay, where the
head pod is for Ray itself), and the server runs with `--max-devices 2 --release-idle-nodes`:

1. a scale to dp 2 needs a device the cluster does not have: the server asks Ray's autoscaler
   for it (`request_resources`, seen in `GET /admin/nodes`); this test plays the autoscaler
   (KubeRay's part: a pod joins with `ray start --address`), and the scale proceeds onto the
   new node once its device is registered;
2. a scale back to dp 1 gives the idle node back (its device unregistered and freed, the ask
   lowered), and the next scale up takes it back without asking;
3. a drained node (`elasticmoe drain-node`, as a worker pod's preStop runs it) moves the model off
   itself (dp 1 on the other node) and is reported removable; the last node is refused;
4. kill -9 of the last node with a device: requests get a 503 at once (never a hang), `/ready`
   says 503, `/health` says why; a node joins and the server serves again on it (the model read
   from disk), with the same greedy text as before.
Streaming clients run throughout steps 1-3 and none of their requests fails.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from streaming_clients import MODEL, PROMPTS, client, client_loop, reference_outputs, scale, wait_event

from coordinator.bench.local_nodes import ray_nodes, serve_on
from hmm.memory import list_segments

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def reference(tiny_model_dir) -> list[tuple[str, int]]:
    return reference_outputs(tiny_model_dir)


@pytest.fixture(scope="module")
def served(tiny_model_dir, reference, paced_engines):
    prefix = f"emoetest{secrets.token_hex(4)}"
    with ray_nodes(head_devices=0, worker_devices=(1,)) as nodes:
        token = nodes.env["RAY_AUTH_TOKEN"]
        with serve_on(nodes, "--model", tiny_model_dir, "--served-model-name", MODEL, "--dtype", "float32",
                      "--device-memory-gb", str(64 / 1024), "--kv-cache-gb", str(8 / 1024), "--shm-prefix", prefix,
                      "--max-devices", "2", "--device-wait", "60", "--release-idle-nodes",
                      "--no-standby-pool") as srv:
            yield srv, nodes
    assert list_segments(prefix) == [], "shared-memory files leaked"
    assert _processes_carrying(f"RAY_AUTH_TOKEN={token}") == [], "processes of the cluster outlived it"


def _processes_carrying(variable: str) -> list[str]:
    """Command lines of the live processes whose environment holds `variable` (the cluster's own
    token: every process of it inherits it, whatever it renames itself to)."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        with contextlib.suppress(OSError):
            if variable.encode() in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0"):
                found.append(Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()[:120])
    return found


def _drain_node(url: str, node: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "elasticmoe.cli", "--log-level", "WARNING", "drain-node", "--url", url,
                           "--node", node, "--timeout-s", "120"], capture_output=True, text=True, timeout=180)


def _nodes(c: httpx.Client) -> dict:
    return c.get("/admin/nodes").json()


def _rank_nodes(c: httpx.Client) -> list[str]:
    return [r["ray_node_id"] for r in c.get("/admin/status").json()["instance"]["ranks"]]


def test_capacity_is_asked_for_given_back_drained_and_lost(served, reference):
    server, nodes = served
    stop = threading.Event()
    with client(server) as c, ThreadPoolExecutor(len(PROMPTS)) as pool:
        (first,) = _rank_nodes(c)
        futures = [pool.submit(client_loop, server, i, stop) for i in range(len(PROMPTS))]
        try:
            time.sleep(1.0)
            # 1. dp 2 needs a second device: asked of the autoscaler, used once a node joins.
            event_id = scale(c, 2)
            deadline = time.monotonic() + 30
            while _nodes(c)["devices_asked_of_autoscaler"] != 2:
                assert time.monotonic() < deadline, _nodes(c)
                time.sleep(0.1)
            assert c.get(f"/admin/scale/{event_id}").json()["state"] == "running"  # waiting for the device
            nodes.add_node(devices=1)  # what KubeRay does with the request: a worker pod joins
            event = wait_event(c, event_id)
            assert event["state"] == "succeeded", event
            second = next(n for n in _rank_nodes(c) if n != first)
            # 2. Back to dp 1: the idle node is given back; dp 2 again takes it back without asking.
            assert wait_event(c, scale(c, 1))["state"] == "succeeded"
            report = {n["ray_node_id"]: n for n in _nodes(c)["nodes"]}
            assert report[second]["state"] == "released" and report[second]["removable"]
            assert _nodes(c)["devices_asked_of_autoscaler"] == 1
            assert second not in {d["ray_node_id"] for d in c.get("/admin/devices").json()["devices"]}
            assert wait_event(c, scale(c, 2))["state"] == "succeeded"
            assert sorted(_rank_nodes(c)) == sorted([first, second])
            # 3. Drain the first node (as a worker pod's preStop does): the model moves to the second
            # (dp 1: no other device), and the command returns once the node may be removed.
            drained = _drain_node(server.url, first)
            assert drained.returncode == 0, drained.stderr
            assert json.loads(drained.stdout)["state"] == "drained" and _rank_nodes(c) == [second]
            refused = _drain_node(server.url, second)  # the only devices: refused, exit 1
            assert refused.returncode == 1 and "409" in refused.stderr
            time.sleep(1.0)
        finally:
            stop.set()
        results = [res for f in futures for res in f.result(timeout=300)]
        assert [res for _, res in results] == [reference[i] for i, _ in results]  # none failed, all identical

        # 4. The last node with a device dies: a clear 503 at once, until capacity returns.
        nodes.kill_node(second)
        deadline = time.monotonic() + 60
        while c.get("/ready").status_code != 503 or "no capacity" not in str(c.get("/health").json()):
            assert time.monotonic() < deadline, c.get("/health").json()
            time.sleep(0.2)
        t0 = time.monotonic()
        r = c.post("/v1/completions", json={"model": MODEL, "prompt": PROMPTS[0], "max_tokens": 4})
        assert r.status_code == 503 and time.monotonic() - t0 < 5, r.text  # refused, not held
        nodes.add_node(devices=1)
        deadline = time.monotonic() + 120
        while c.get("/ready").status_code != 200:
            assert time.monotonic() < deadline, c.get("/health").json()
            time.sleep(0.2)
        body = {"model": MODEL, "prompt": PROMPTS[1], "max_tokens": 200, "temperature": 0, "ignore_eos": True}
        out = c.post("/v1/completions", json=body).json()
        assert out["choices"][0]["text"] == reference[1][0]
        heal = [e for e in c.get("/admin/status").json()["scale_events"] if e["strategy"] == "heal"][-1]
        assert heal["state"] == "succeeded" and heal["bytes_moved"]["bytes_disk"] > 0  # everything from disk
