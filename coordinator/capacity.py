"""Capacity that comes and goes: what the coordinator knows of each node, and what it asks Ray for.

A node offers devices (`elasticmoe_device`). Its devices are registered while it is `active`;
an operator drains it (`draining`: a scale moves the model off it; then `drained`: its devices
are unregistered and freed, it may be removed); the coordinator gives an idle one back
(`released`: same as drained, the autoscaler may reclaim it); it dies (`lost`: its devices are
forgotten and the model re-planned onto the survivors). A node in any state but `active` is
never registered again while it stays in the cluster; one that leaves is forgotten (a node that
comes back has a new Ray node id).

`DeviceRequests` asks Ray's autoscaler for devices a scale needs beyond those registered
(`ray.autoscaler.sdk.request_resources` on `elasticmoe_device`, which KubeRay turns into worker
pods) and lowers the ask after a scale-down, so idle nodes can be reclaimed.
"""

from __future__ import annotations

import enum
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

from hmm.placement import DEVICE_RESOURCE

logger = logging.getLogger(__name__)


class NodeState(enum.StrEnum):
    ACTIVE = "active"
    DRAINING = "draining"
    DRAINED = "drained"
    RELEASED = "released"
    LOST = "lost"


@dataclass
class NodeRecord:
    ray_node_id: str
    state: NodeState
    since: float  # epoch seconds of the last state change
    event_id: str | None = None  # the scale that moved the model off it (a drain)
    detail: str | None = None

    @property
    def is_removable(self) -> bool:
        """Nothing of the server runs there: the node may be shut down."""
        return self.state in (NodeState.DRAINED, NodeState.RELEASED, NodeState.LOST)

    def describe(self) -> dict[str, Any]:
        return {**asdict(self), "state": self.state.value, "removable": self.is_removable}


MAX_RECORDS = 256  # nodes remembered (the oldest gone ones are dropped first)


class NodeBook:
    """The nodes that are not (or no longer) simply `active`, and those gone (lost, or removed
    after a drain: shown, never used again; a node that comes back has a new id). Thread-safe."""

    def __init__(self) -> None:
        self._records: dict[str, NodeRecord] = {}
        self._lock = threading.Lock()

    def state(self, ray_node_id: str | None) -> NodeState:
        record = self._records.get(ray_node_id or "")
        return record.state if record is not None else NodeState.ACTIVE

    def record(self, ray_node_id: str) -> NodeRecord | None:
        return self._records.get(ray_node_id)

    def mark(self, ray_node_id: str, state: NodeState, **details: Any) -> NodeRecord:
        """Set a node's state (an `active` one is only remembered with details, e.g. why a drain failed)."""
        with self._lock:
            record = NodeRecord(ray_node_id, state, time.time(), **details)
            self._records.pop(ray_node_id, None)
            if state is not NodeState.ACTIVE or details:
                self._records[ray_node_id] = record  # (re)inserted last: the newest
            while len(self._records) > MAX_RECORDS:
                del self._records[next(iter(self._records))]
            return record

    def excluded(self) -> set[str]:
        """Nodes whose devices must not be registered or used."""
        return {n for n, r in list(self._records.items()) if r.state is not NodeState.ACTIVE}

    def describe(self) -> list[dict[str, Any]]:
        return [r.describe() for r in sorted(self._records.values(), key=lambda r: r.since)]


def _request_resources(bundles: list[dict[str, float]]) -> None:
    from ray.autoscaler.sdk import request_resources

    request_resources(bundles=bundles)


class DeviceRequests:
    """The number of devices this server asks Ray's autoscaler to keep in the cluster."""

    def __init__(self, request: Callable[[list[dict[str, float]]], None] = _request_resources) -> None:
        self._request = request
        self.num_asked = 0

    def ask(self, num_devices: int) -> None:
        """Ask for `num_devices` devices in all (a minimum the autoscaler scales to; 0: none)."""
        if num_devices == self.num_asked:
            return
        try:
            self._request([{DEVICE_RESOURCE: 1.0}] * num_devices)
        except Exception:  # noqa: BLE001 - no autoscaler to ask (a local cluster): nothing joins
            logger.warning("could not ask Ray's autoscaler for %d devices", num_devices, exc_info=True)
            return
        logger.info("asked Ray's autoscaler for %d devices (was %d)", num_devices, self.num_asked)
        self.num_asked = num_devices
