"""Capacity that comes and goes (`coordinator.capacity`, the cluster's device bookkeeping in
`coordinator.node_pool`), without Ray: node states and what they exclude, the devices asked of
Ray's autoscaler, targets that leave a node's devices, giving idle nodes back, and waiting for
asked devices (or timing out)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from elastic_server import tiny_config
from hmm_factories import BUDGET, KV, make_sizes

import coordinator.cluster as cluster_module
import coordinator.node_pool as node_pool_module
from coordinator.capacity import DeviceRequests, NodeBook, NodeState
from coordinator.nodes import DeviceNode
from hmm.layout import DeviceSpec, layout_for
from hmm.placement import DEVICE_RESOURCE

A, B, C = "a" * 56, "b" * 56, "c" * 56  # Ray node ids


def test_nodes_in_any_state_but_active_are_excluded_until_they_leave():
    book = NodeBook()
    assert book.state(A) is NodeState.ACTIVE and book.excluded() == set()
    book.mark(A, NodeState.DRAINING)
    book.mark(B, NodeState.DRAINED, event_id="scale-3")
    book.mark(C, NodeState.ACTIVE, detail="drain failed: rolled back")  # remembered, not excluded
    assert book.excluded() == {A, B}
    assert {r["ray_node_id"]: r["removable"] for r in book.describe()} == {A: False, B: True, C: False}
    book.mark(A, NodeState.ACTIVE)
    assert book.excluded() == {B} and [r["ray_node_id"] for r in book.describe()] == [B, C]


def test_devices_are_asked_of_the_autoscaler_once_per_change():
    asked: list[list[dict]] = []
    requests = DeviceRequests(asked.append)
    requests.ask(3)
    requests.ask(3)
    requests.ask(1)
    assert asked == [[{DEVICE_RESOURCE: 1.0}] * 3, [{DEVICE_RESOURCE: 1.0}]] and requests.num_asked == 1

    def no_autoscaler(bundles: list[dict]) -> None:
        raise ConnectionError("no autoscaler")

    failing = DeviceRequests(no_autoscaler)
    failing.ask(2)  # logged, not raised: a local cluster has nobody to ask
    assert failing.num_asked == 0


def _cluster(tiny_model_dir, monkeypatch, layout_nodes, free_nodes, **overrides):
    """A cluster whose HMM holds devices on these nodes: the layout's first, then free ones."""
    nodes = [*layout_nodes, *free_nodes]
    devices = [DeviceSpec(i, ord(n[0]) - ord("a"), BUDGET, n) for i, n in enumerate(nodes)]
    layout = layout_for(None, make_sizes(), devices[: len(layout_nodes)], len(layout_nodes), len(layout_nodes),
                        kv_bytes=KV)
    removed: list[int] = []

    def remove_device(d: int) -> None:
        removed.append(d)
        del hmm.devices[d]

    hmm = SimpleNamespace(devices={d.device_id: d for d in devices}, layout=layout, remove_device=remove_device)
    cluster = cluster_module.ClusterManager(tiny_config(tiny_model_dir, num_devices=len(nodes), **overrides))
    cluster.hmm = hmm  # type: ignore[assignment]
    cluster.home_node = A
    cluster.standby.retire_where = lambda condition: 0  # type: ignore[method-assign]
    monkeypatch.setattr(cluster, "prepare_standby", lambda delay_s=0.0: None)
    return cluster, hmm, removed


def test_a_draining_node_leaves_the_target_and_is_replaced(tiny_model_dir, monkeypatch):
    cluster, hmm, _ = _cluster(tiny_model_dir, monkeypatch, [A, B], [C])
    cluster.nodes.mark(B, NodeState.DRAINING)
    assert list(cluster.usable_devices()) == [0, 2]
    target = cluster.target(2)  # the same dp: device 1 (node B) replaced by device 2 (node C)
    assert [d.device_id for d in target.devices] == [0, 2]
    assert [d.device_id for d in cluster.target(1).devices] == [0]


def test_idle_nodes_go_back_but_never_the_coordinators_own(tiny_model_dir, monkeypatch):
    cluster, hmm, removed = _cluster(tiny_model_dir, monkeypatch, [A], [A, B, C], release_idle_nodes=True)
    asked: list[int] = []
    cluster.device_requests = DeviceRequests(lambda bundles: asked.append(len(bundles)))
    cluster.device_requests.ask(4)
    assert sorted(cluster.release_idle_nodes()) == [B, C]
    assert removed == [2, 3] and list(hmm.devices) == [0, 1]  # the home node keeps its free device
    assert cluster.nodes.state(B) is NodeState.RELEASED and asked == [4, 1]  # the ask lowered to the layout
    off, _, off_removed = _cluster(tiny_model_dir, monkeypatch, [A], [B])
    assert off.release_idle_nodes() == [] and off_removed == []  # the option is off: nothing goes back


def test_a_scale_waits_for_asked_devices_and_gives_up_naming_them(tiny_model_dir, monkeypatch):
    cluster, hmm, _ = _cluster(tiny_model_dir, monkeypatch, [A], [])
    cluster.nodes.mark(B, NodeState.RELEASED)
    offered = [DeviceNode(A, "10.0.0.1", 1), DeviceNode(B, "10.0.0.2", 1)]
    monkeypatch.setattr(node_pool_module, "discover", lambda: offered)
    added: list[DeviceSpec] = []
    hmm.add_devices = lambda specs: [(added.append(s), hmm.devices.__setitem__(s.device_id, s)) for s in specs]
    cluster._next_device_id = 1
    asked: list[int] = []
    cluster.device_requests = DeviceRequests(lambda bundles: asked.append(len(bundles)))
    cluster.acquire_devices(2, timeout_s=5)  # the released node comes back first: nothing asked
    assert [s.ray_node_id for s in added] == [B] and asked == []
    with pytest.raises(TimeoutError, match=f"needs 3 devices, 2 registered; asked .* 3 `{DEVICE_RESOURCE}`"):
        cluster.acquire_devices(3, timeout_s=0.2, poll_s=0.05)
    assert asked == [3]
    offered.append(DeviceNode(C, "10.0.0.3", 1))  # the autoscaler's node joined
    cluster.acquire_devices(3, timeout_s=5, poll_s=0.05)
    assert [s.device_id for s in added] == [1, 2] and added[-1].ray_node_id == C
