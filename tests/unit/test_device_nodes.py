"""Devices come from Ray nodes (`coordinator.nodes`, `hmm.placement`): which nodes offer them, how
they are numbered, and the scheduling options that keep an actor on its device's node."""

from __future__ import annotations

import pytest
import ray
from elastic_server import tiny_config
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

import coordinator.cluster as cluster_module
import coordinator.node_pool as node_pool_module
from coordinator.nodes import DeviceNode, device_specs, discover
from elasticmoe.cli import main
from hmm.layout import DeviceSpec
from hmm.placement import DEVICE_RESOURCE, on_node
from imm.instance import Instance


def _node(node_id: str, address: str, devices: float | None, alive: bool = True) -> dict:
    resources = {"CPU": 1.0, **({DEVICE_RESOURCE: devices} if devices is not None else {})}
    return {"NodeID": node_id, "NodeManagerAddress": address, "Alive": alive, "Resources": resources}


def test_only_alive_nodes_offering_devices_count_the_given_first():
    nodes = [_node("c", "10.0.0.3", 2), _node("a", "10.0.0.1", 1), _node("dead", "10.0.0.4", 4, alive=False),
             _node("cpu-only", "10.0.0.5", None), _node("b", "10.0.0.2", 2.0)]
    found = discover(nodes, first="c")
    assert found == [DeviceNode("c", "10.0.0.3", 2), DeviceNode("a", "10.0.0.1", 1), DeviceNode("b", "10.0.0.2", 2)]
    assert discover([_node("a", "x", 0.5)], first=None) == []  # a fraction of a device is none


def test_devices_are_numbered_node_by_node():
    specs = device_specs([DeviceNode("c", "10.0.0.3", 2), DeviceNode("a", "10.0.0.1", 1)], budget_bytes=1 << 20)
    assert specs == [DeviceSpec(0, 0, 1 << 20, "c"), DeviceSpec(1, 0, 1 << 20, "c"), DeviceSpec(2, 1, 1 << 20, "a")]
    assert [s.device_id for s in device_specs([DeviceNode("d", "x", 2)], 1, first_id=5)] == [5, 6]


def test_an_actor_is_pinned_to_its_node_and_a_device_worker_takes_a_device():
    assert on_node(None) == {} and on_node(None, device=True) == {}
    node = "ab" * 28  # a Ray node id: 28 bytes in hex
    rank = on_node(node)
    assert isinstance(rank["scheduling_strategy"], NodeAffinitySchedulingStrategy) and "resources" not in rank
    assert rank["scheduling_strategy"].node_id == node and rank["scheduling_strategy"].soft is False
    assert on_node(node, device=True)["resources"] == {DEVICE_RESOURCE: 1}


def test_a_cluster_offering_fewer_devices_than_dp_is_refused_naming_the_resource(tiny_model_dir, monkeypatch):
    monkeypatch.setattr(node_pool_module, "discover", lambda: [DeviceNode("a" * 56, "10.0.0.1", 1)])
    cluster = cluster_module.ClusterManager(tiny_config(tiny_model_dir, num_devices=2, dp=2))
    with pytest.raises(RuntimeError, match=f"--dp: 2 ranks need 2 devices; .* offer 1 .*{DEVICE_RESOURCE}"):
        cluster._offered_devices()
    monkeypatch.setattr(node_pool_module, "discover", lambda: [DeviceNode("a" * 56, "10.0.0.1", 2)])
    assert [s.ray_node_id for s in cluster._offered_devices()] == ["a" * 56] * 2


def test_an_instance_needs_one_node_per_rank():
    with pytest.raises(ValueError, match="nodes: one per rank, got 1 for dp 2"):
        Instance.create_standby("unused", 2, nodes=("a" * 56,))


def test_joining_an_unreachable_cluster_exits_2_naming_the_token(tiny_model_dir, monkeypatch, capsys):
    """`--address` to a cluster that refuses this process (down, or token authentication without
    the token): exit 2 with what to set, before anything is started."""
    def refuse(**kwargs):
        raise ConnectionError("Failed to connect to Ray cluster at 10.0.0.1:6379")

    monkeypatch.setattr(ray, "init", refuse)
    assert main(["serve", "--model", tiny_model_dir, "--address", "10.0.0.1:6379"]) == 2
    err = capsys.readouterr().err
    assert "--address 10.0.0.1:6379: cannot join" in err and "RAY_AUTH_TOKEN" in err
