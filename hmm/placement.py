"""Where an actor runs: on the Ray node of its device (`DeviceSpec.ray_node_id`).

A device worker maps its device's memory and a rank maps the same pages (zero-copy), so
both must run on the device's node. The worker also takes one unit of the node's
`elasticmoe_device` resource: Ray, and the autoscaler behind KubeRay, then count the
devices in use, and two servers on one cluster never hold the same device.
"""

from __future__ import annotations

from typing import Any

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

DEVICE_RESOURCE = "elasticmoe_device"


def on_node(ray_node_id: str | None, device: bool = False) -> dict[str, Any]:
    """Actor options that pin it to `ray_node_id` (none for None); `device`: it holds one of the
    node's devices (the device worker), so it takes a unit of `elasticmoe_device`."""
    if ray_node_id is None:
        return {}
    options: dict[str, Any] = {"scheduling_strategy": NodeAffinitySchedulingStrategy(ray_node_id, soft=False)}
    if device:
        options["resources"] = {DEVICE_RESOURCE: 1}
    return options


def node_address() -> str:
    """This process's node address, where processes on other nodes reach it (Ray's node IP;
    127.0.0.1 outside Ray)."""
    return ray.util.get_node_ip_address() if ray.is_initialized() else "127.0.0.1"


def ray_node_id() -> str | None:
    """The Ray node this process runs on (None outside Ray)."""
    return ray.get_runtime_context().get_node_id() if ray.is_initialized() else None
