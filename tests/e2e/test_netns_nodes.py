"""Elastic scaling across a real network interface: the worker node in its own network namespace.

A head on the host (one device, at the bridge's address) and one worker node (one device) in a
network namespace of its own, wired to the host's bridge by a veth pair
(`ray_nodes(netns=True)`, `coordinator/bench/netns.py`); the server (`elasticmoe serve
--address`) runs on the host. Under four streaming clients the server scales dp 1 -> 2 -> 1:
no request fails, every stream equals the single-process run, the weights that crossed to the
namespaced node went by p2p over gloo, and the veth carried at least those bytes (nothing can
take a shortcut over a shared loopback). After the shutdown no /dev/shm file of the server and
no namespace, veth or bridge is left; nor after a start that fails once a namespace exists.
"""

from __future__ import annotations

import secrets
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from streaming_clients import MODEL, PROMPTS, client, client_loop, reference_outputs, scale, wait_event

from coordinator.bench.local_nodes import RayNodes, ray_nodes, serve_on
from coordinator.bench.netns import NodeNetwork, netns_unavailable
from hmm.memory import list_segments

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def reference(tiny_model_dir) -> list[tuple[str, int]]:
    return reference_outputs(tiny_model_dir)


@pytest.fixture
def can_netns() -> None:
    if (reason := netns_unavailable()) is not None:
        pytest.skip(f"needs network namespaces (root): {reason}")


def _veth_bytes(nodes: RayNodes) -> int:
    return sum(nodes.interface_bytes().values())


def test_scaling_onto_a_namespaced_node_moves_weights_over_its_veth(can_netns, tiny_model_dir, reference,
                                                                    paced_engines):
    prefix = f"emoetest{secrets.token_hex(4)}"
    stop = threading.Event()
    events, crossed = [], []
    with ray_nodes(head_devices=1, worker_devices=(1,), netns=True) as nodes:
        assert nodes.network is not None
        network = nodes.network
        with serve_on(nodes, "--model", tiny_model_dir, "--served-model-name", MODEL, "--dtype", "float32",
                      "--device-memory-gb", str(64 / 1024), "--kv-cache-gb", str(8 / 1024),
                      "--shm-prefix", prefix) as server, client(server) as c:
            addresses = {n["address"] for n in c.get("/admin/nodes").json()["nodes"]}
            assert addresses == {network.bridge_address, f"{network.subnet}.2"}  # the host's, the namespace's
            with ThreadPoolExecutor(len(PROMPTS)) as pool:
                futures = [pool.submit(client_loop, server, i, stop) for i in range(len(PROMPTS))]
                try:
                    time.sleep(1.0)  # every client is mid-stream
                    for dp in (2, 1):
                        before = _veth_bytes(nodes)
                        events.append(wait_event(c, scale(c, dp)))
                        crossed.append(_veth_bytes(nodes) - before)
                        assert events[-1]["state"] == "succeeded", events[-1]
                        ranks = c.get("/admin/status").json()["instance"]["ranks"]
                        assert len({r["running_on"] for r in ranks}) == dp  # dp 2: one rank on each node
                        time.sleep(0.5)  # streams progress on the new instance
                finally:
                    stop.set()
                results = [r for f in futures for r in f.result(timeout=300)]
        assert network.leftovers() != []  # still there while the nodes run
    assert list_segments(prefix) == [], "shared-memory files leaked"
    assert network.leftovers() == [], "a namespace, veth or bridge outlived the cluster"

    # No request failed (a failure raises above) and each equals the single-process run.
    assert [res for _, res in results] == [reference[i] for i, _ in results]
    assert len(results) >= len(PROMPTS)
    p2p = [e["bytes_moved"]["bytes_p2p_gloo"] for e in events]
    assert p2p[0] > 0, events[0]["bytes_moved"]  # dp 2: the new rank's weights went to the namespace by gloo
    assert all(c >= b for c, b in zip(crossed, p2p, strict=True)), (crossed, p2p)
    for event, veth in zip(events, crossed, strict=True):
        print(f"\nscale dp {event['from_dp']}->{event['to_dp']}: latency {event['scale_latency_s']:.2f}s, "
              f"p2p gloo {event['bytes_moved']['bytes_p2p_gloo'] / 2**20:.2f} MiB, veth {veth / 2**20:.2f} MiB")


def test_a_start_failing_midway_leaves_no_namespace(can_netns, monkeypatch):
    """The worker node's `ray start` fails once its namespace and veth exist: all is removed."""
    networks: list[NodeNetwork] = []

    def start(self: RayNodes, *args: str, devices: int, cpus: int, prefix: tuple[str, ...] = ()) -> None:
        assert self.network is not None
        networks.append(self.network)
        if prefix:  # run in the worker's namespace
            assert len(self.network.leftovers()) == 3  # the namespace, the bridge, the host's veth end
            raise RuntimeError("ray start failed")

    monkeypatch.setattr(RayNodes, "_start", start)
    with pytest.raises(RuntimeError, match="ray start failed"), ray_nodes(worker_devices=(1,), netns=True):
        pass
    assert len(networks[-1].namespaces) == 1 and networks[-1].leftovers() == []
