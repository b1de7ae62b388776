"""Devices come from Ray nodes: each node offers logical devices as the custom resource
`elasticmoe_device` (`ray start --resources '{"elasticmoe_device": 2}'`; the local cluster
of `elasticmoe serve --devices N` offers N on its one node).

`discover` reads the alive nodes that offer it; `device_specs` numbers their devices
(node by node, the node of the driver first, so a single-host cluster keeps today's
ids); the device workers and ranks are then placed on their device's node, and each
worker
takes one unit of the resource, so that Ray (and KubeRay's autoscaler) see the devices
in use and two servers never share one (`hmm.placement`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import ray

from hmm.layout import DeviceSpec
from hmm.placement import DEVICE_RESOURCE


@dataclass(frozen=True, slots=True)
class DeviceNode:
    """An alive Ray node and the number of devices it offers."""

    ray_node_id: str
    address: str
    num_devices: int


def discover(nodes: Sequence[dict[str, Any]] | None = None, first: str | None = None) -> list[DeviceNode]:
    """Alive nodes offering `elasticmoe_device` (`ray.nodes()` unless given), `first` (a node id:
    default this process's) first, then by address and id."""
    if nodes is None:
        nodes = ray.nodes()
        first = first or ray.get_runtime_context().get_node_id()
    found = [DeviceNode(n["NodeID"], n.get("NodeManagerAddress", ""), int(n["Resources"][DEVICE_RESOURCE]))
             for n in nodes if n.get("Alive") and n.get("Resources", {}).get(DEVICE_RESOURCE, 0) >= 1]
    return sorted(found, key=lambda n: (n.ray_node_id != first, n.address, n.ray_node_id))


def device_specs(nodes: Sequence[DeviceNode], budget_bytes: int, first_id: int = 0) -> list[DeviceSpec]:
    """One `DeviceSpec` per offered device, ids from `first_id`, node indices in `nodes`' order."""
    specs: list[DeviceSpec] = []
    for index, node in enumerate(nodes):
        for _ in range(node.num_devices):
            specs.append(DeviceSpec(first_id + len(specs), index, budget_bytes, node.ray_node_id))
    return specs


def alive_node_ids() -> set[str]:
    """The ids of the Ray nodes that are alive now."""
    return {n["NodeID"] for n in ray.nodes() if n.get("Alive")}
