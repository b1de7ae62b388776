"""Draining a node: move the model off it with the zero-downtime switchover, then give its devices back.

`POST /admin/nodes/{node_id}/drain` starts it (202); `GET /admin/nodes/{node_id}` says how it
goes. In order, on a background thread:

1. the node is marked `draining`: its devices are no longer used by any scale or standby boot;
2. if the active instance uses one of them, a scale (strategy `drain`) moves it to the devices
   that stay, at the same dp if enough stay, else at as many as stay; running requests are handed
   over as in any scale (with their KV where their device stays);
3. its devices are unregistered: their workers free their memory and exit, which returns the
   node's `elasticmoe_device` resources; pooled standby instances with a rank there are retired;
4. the node is `drained`: `removable` is true, it may be shut down (it is never registered
   again while it stays in the cluster; a node that comes back joins with a new id).

A drain that cannot move the model (the scale rolled back) puts the node back to `active`,
with the reason. Refused with 409: the node holds the only devices, it is already draining or
drained, or another scale runs; 404: no device of this server is on that node.
"""

from __future__ import annotations

import logging
import threading
from typing import TYPE_CHECKING, Any

from coordinator.capacity import NodeState
from coordinator.nodes import discover
from coordinator.scale_events import ScaleConflict, ScaleState
from coordinator.scaler import NoCapacity, Scaler
from elasticmoe.entrypoints.openai.errors import OpenAIError
from elasticmoe.errors import describe_error

if TYPE_CHECKING:
    from coordinator.cluster import ClusterManager

logger = logging.getLogger(__name__)


class NodeDrainer:
    def __init__(self, cluster: ClusterManager, scaler: Scaler) -> None:
        self.cluster, self.scaler = cluster, scaler
        self._lock = threading.Lock()  # one drain starts at a time (their scales serialise anyway)
        self.thread: threading.Thread | None = None

    def resolve(self, node: str) -> str:
        """The full Ray node id `node` names among the nodes this server knows: an id, a unique
        prefix of at least 6 characters, or the address of exactly one node (a pod's IP);
        `OpenAIError` 404 otherwise."""
        hmm = self.cluster.hmm
        known = {s.ray_node_id for s in dict(hmm.devices if hmm is not None else {}).values()}
        known |= {r["ray_node_id"] for r in self.cluster.nodes.describe()}
        known.discard(None)
        if node in known:
            return node
        matches = [n for n in known if n is not None and len(node) >= 6 and n.startswith(node)]
        if not matches:
            matches = [n.ray_node_id for n in discover() if n.address == node and n.ray_node_id in known]
        if len(matches) == 1 and matches[0] is not None:
            return matches[0]
        raise OpenAIError(f"No node {node[:64]!r} offers devices to this server.", status_code=404,
                          param="node_id")

    def describe(self, node: str) -> dict[str, Any]:
        node = self.resolve(node)
        record = self.cluster.nodes.record(node)
        hmm = self.cluster.hmm
        devices = sorted(d for d, s in dict(hmm.devices if hmm is not None else {}).items() if s.ray_node_id == node)
        if record is None:
            return {"ray_node_id": node, "state": NodeState.ACTIVE.value, "removable": False, "devices": devices}
        return {**record.describe(), "devices": devices}

    def start(self, node: str) -> dict[str, Any]:
        """Validate and start draining `node` in the background (see the module docstring)."""
        node = self.resolve(node)
        with self._lock:
            state = self.cluster.nodes.state(node)
            if state is not NodeState.ACTIVE:
                raise OpenAIError(f"Node {node[:12]} is {state.value}.", status_code=409, param="node_id")
            if self.cluster.scale_events.running is not None:
                raise OpenAIError("A scale is running; drain when it has finished.", status_code=409,
                                  param="node_id")
            hmm = self.cluster.hmm
            assert hmm is not None
            mine = {d for d, s in dict(hmm.devices).items() if s.ray_node_id == node}
            others = [d for d in self.cluster.usable_devices() if d not in mine]
            in_use = hmm.layout is not None and bool(mine & set(hmm.layout.device_ids))
            if in_use and not others:
                raise OpenAIError(f"Node {node[:12]} holds the only devices; add a node before draining it.",
                                  status_code=409, param="node_id")
            self.cluster.nodes.mark(node, NodeState.DRAINING)
            self.thread = threading.Thread(target=self._run, args=(node, in_use), name=f"drain-{node[:8]}",
                                           daemon=True)
            self.thread.start()
        return self.describe(node)

    def _run(self, node: str, in_use: bool) -> None:
        nodes = self.cluster.nodes
        event_id = None
        try:
            if in_use:
                event = self.scaler.move_off(f"drain of node {node[:12]}")
                event_id = event.event_id
                if event.state is not ScaleState.SUCCEEDED:
                    nodes.mark(node, NodeState.ACTIVE, event_id=event_id, detail=f"drain failed: {event.error}")
                    logger.error("drain of node %s failed: %s", node[:8], event.error)
                    return
            ids = self.cluster.remove_node_devices(node)
        except (ScaleConflict, NoCapacity, Exception) as exc:  # noqa: BLE001 - reported on the node
            nodes.mark(node, NodeState.ACTIVE, event_id=event_id, detail=f"drain failed: {describe_error(exc)}")
            logger.exception("drain of node %s failed", node[:8])
            return
        nodes.mark(node, NodeState.DRAINED, event_id=event_id, detail=f"devices {ids} unregistered and freed")
        logger.info("node %s drained (devices %s); it may be removed", node[:8], ids)

    def join(self, timeout_s: float = 120.0) -> None:
        if self.thread is not None:
            self.thread.join(timeout_s)
