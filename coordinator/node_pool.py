"""`NodePool`: the nodes and devices a cluster runs on, as nodes join, are drained, given back or lost.

Every device a node offers (`elasticmoe_device`, found by `coordinator.nodes.discover`) is
registered with the HMM (a device worker on its node) at the start and, while serving, when its
node joins (a thread watches the Ray cluster). A node leaves drained (`coordinator.node_drain`) or
given back idle (`release_idle_nodes`): its devices are removed; a node that died is lost: its
devices are forgotten (`forget_lost_node`). What is known of each node and what is asked of Ray's
autoscaler are `coordinator.capacity`'s `NodeBook` and `DeviceRequests`. Which devices a scale may
use (`usable_devices`, `target`) is decided here too.

`ClusterManager` extends this pool: the HMM, the instances and their standby pool are its.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING

import ray

from coordinator.capacity import DeviceRequests, NodeBook, NodeState
from coordinator.nodes import alive_node_ids, device_specs, discover
from hmm.layout import DeviceSpec
from hmm.memory.lease import reap
from hmm.placement import DEVICE_RESOURCE
from hmm.planner import TargetConfig, scale_target

if TYPE_CHECKING:
    from coordinator.config import CoordinatorConfig
    from hmm.controller import HMMController
    from imm.manager import InstanceManager
    from imm.rank_processes import RankProcessPool

logger = logging.getLogger(__name__)

NODE_WATCH_INTERVAL_S = 2.0  # how often the Ray cluster is checked for nodes that joined


class NodePool:
    """The cluster's nodes (`nodes`: those not simply active), the devices they offer registered
    with the HMM, and the devices asked of Ray's autoscaler (`device_requests`). The registry
    changes only under `devices_lock`."""

    # Provided by the class this pool is part of (`ClusterManager`).
    config: CoordinatorConfig
    hmm: HMMController | None
    standby: InstanceManager
    processes: RankProcessPool
    _closing: threading.Event
    _is_shut_down: bool
    prepare_standby: Callable[[], None]  # called when devices joined: dp+1 may fit now

    def __init__(self) -> None:
        # NOTE: the device registry changes only under this lock: a scale holds it from its target
        # to its end, a node that joins takes it to register its devices (`register_joined`).
        self.devices_lock = threading.RLock()
        self._node_watch: threading.Thread | None = None
        self.nodes = NodeBook()  # nodes draining, drained, released or lost (`coordinator.capacity`)
        self.device_requests = DeviceRequests()
        # Ids never reused: a lost device stays in the committed layout until the next plan.
        self._next_device_id = 0
        self._node_index: dict[str | None, int] = {}
        self.home_node: str | None = None  # the coordinator's own node (never given back)

    # ---- devices that come with nodes -----------------------------------------------------

    def _register_offered(self, offered: list[DeviceSpec]) -> None:
        """Register `offered`, every device the cluster's nodes offer at the start (`_offered_devices`)."""
        hmm = self.hmm
        assert hmm is not None
        self.home_node = ray.get_runtime_context().get_node_id()
        hmm.add_devices(offered)
        for spec in offered:
            self._next_device_id = spec.device_id + 1
            self._node_index.setdefault(spec.ray_node_id, spec.node_id)

    def _start_node_watch(self) -> None:
        """Register the devices of nodes that join from now on (checked every `NODE_WATCH_INTERVAL_S`)."""
        self._node_watch = threading.Thread(target=self._watch_nodes, name="node-watch", daemon=True)
        self._node_watch.start()

    def _join_node_watch(self) -> None:
        """Wait for the node watch to end (after `_closing` is set)."""
        if self._node_watch is not None:
            self._node_watch.join(timeout=30)

    def _offered_devices(self) -> list[DeviceSpec]:
        """Every device the cluster's nodes offer (`elasticmoe_device`), at least dp of them."""
        specs = device_specs(discover(), self.config.device_memory_bytes)
        if len(specs) < self.config.dp:
            raise RuntimeError(
                f"--dp: {self.config.dp} ranks need {self.config.dp} devices; the Ray cluster's nodes offer "
                f"{len(specs)} (start nodes with --resources '{{\"{DEVICE_RESOURCE}\": N}}')")
        return specs

    def register_joined(self) -> list[DeviceSpec]:
        """Register the devices of nodes that joined the Ray cluster since the start (or that
        offer more now): each gets a worker on its node and joins the p2p group (paper D.6); the
        next scale may use it. Returns the new devices."""
        with self.devices_lock:
            hmm = self.hmm
            if hmm is None or self._is_shut_down:
                return []
            have = collections.Counter(spec.ray_node_id for spec in hmm.devices.values())
            offered = discover()
            excluded = self.nodes.excluded()
            added: list[DeviceSpec] = []
            for node in offered:
                if node.ray_node_id in excluded:
                    continue
                for _ in range(node.num_devices - have[node.ray_node_id]):
                    node_index = self._node_index.setdefault(node.ray_node_id, max(self._node_index.values(),
                                                                                   default=-1) + 1)
                    spec = DeviceSpec(self._next_device_id, node_index, self.config.device_memory_bytes,
                                      node.ray_node_id)
                    self._next_device_id += 1
                    added.append(spec)
            hmm.add_devices(added)
        if added:
            logger.info("coordinator: devices %s joined (nodes %s)", [s.device_id for s in added],
                        sorted({str(s.ray_node_id)[:8] for s in added}))
            self.prepare_standby()  # dp+1 may fit now
        return added

    def _watch_nodes(self, interval_s: float = NODE_WATCH_INTERVAL_S) -> None:
        while not self._closing.wait(interval_s):
            try:
                self.register_joined()
            except Exception:  # noqa: BLE001 - a node that cannot be registered now is tried again
                logger.exception("coordinator: registering a joined node failed")

    # ---- where instances run ------------------------------------------------------------------

    def usable_devices(self) -> dict[int, DeviceSpec]:
        """Registered devices a scale may use: not on a node being drained (a copy, not the lock:
        the pool's boot computes targets while a scale, holding the lock, may wait for that boot)."""
        hmm = self.hmm
        if hmm is None:
            return {}
        excluded = self.nodes.excluded()
        return {d: spec for d, spec in sorted(dict(hmm.devices).items()) if spec.ray_node_id not in excluded}

    def target(self, to_dp: int, fresh_devices: bool = False,
               expert_load: Sequence[float] | None = None) -> TargetConfig:
        """The devices a scale to `to_dp` uses: scale-up appends free devices to the current ones,
        scale-down keeps the lowest ids (`hmm.planner.scale_target`); `fresh_devices`: only free
        ones (a strategy that never shares a device between the old and the new instance). Current
        devices that are leaving (a node being drained, or lost) are replaced like missing ones.
        `expert_load` (tokens routed per expert): the placement balances it across the ranks."""
        hmm = self.hmm
        assert hmm is not None and hmm.layout is not None
        layout = hmm.layout
        usable = self.usable_devices()
        free = [spec for d, spec in usable.items() if d not in layout.device_ids]
        leaving = [d for d in layout.device_ids if d not in usable]
        kv, replicated = self.config.hmm_kv_bytes, not self.config.is_expert_parallel
        load = tuple(float(x) for x in expert_load) if expert_load is not None else None
        if fresh_devices:
            return TargetConfig(tuple(free[:to_dp]), to_dp, 1 if replicated else to_dp, kv_bytes=kv, expert_load=load)
        return scale_target(layout, to_dp, free, kv_bytes=kv, leaving=leaving, replicated=replicated,
                            expert_load=load)

    # ---- capacity: devices that come and go (see `coordinator.capacity`) --------------------------

    def acquire_devices(self, num_devices: int, timeout_s: float, poll_s: float = 0.5) -> None:
        """Make `num_devices` devices usable: nodes this server gave back come back first, then
        Ray's autoscaler is asked for the rest (KubeRay turns the ask into worker pods); returns
        once they are registered. `TimeoutError` naming what is missing after `timeout_s`."""
        if len(self.usable_devices()) >= num_devices:
            return
        for record in self.nodes.describe():
            if record["state"] == NodeState.RELEASED.value:
                self.nodes.mark(record["ray_node_id"], NodeState.ACTIVE)
        self.register_joined()
        if len(self.usable_devices()) >= num_devices:
            return
        self.device_requests.ask(num_devices)
        deadline = time.monotonic() + timeout_s
        while len(self.usable_devices()) < num_devices:
            if time.monotonic() >= deadline or self._closing.wait(poll_s):
                have = len(self.usable_devices())
                raise TimeoutError(
                    f"needs {num_devices} devices, {have} registered; asked Ray's autoscaler for "
                    f"{num_devices} `{DEVICE_RESOURCE}`, and not enough joined within {timeout_s:.0f} s")
            self.register_joined()

    def remove_node_devices(self, ray_node_id: str) -> list[int]:
        """Unregister and free the devices of a node the model no longer uses (drained, given
        back); pooled standby instances with a rank there are retired. Returns the device ids."""
        with self.devices_lock:
            hmm = self.hmm
            assert hmm is not None
            ids = [d for d, spec in dict(hmm.devices).items() if spec.ray_node_id == ray_node_id]
            for d in ids:
                hmm.remove_device(d)
        self.standby.retire_where(lambda inst: ray_node_id in getattr(inst, "nodes", ()))
        self.processes.drop_node(ray_node_id)
        return ids

    def forget_lost_node(self, ray_node_id: str) -> list[int]:
        """A node died: its devices are forgotten (no call reaches them; the next plan neither
        reads nor frees them), pooled standby instances with a rank there are retired, and the
        shared memory its workers left is freed wherever we can reach it."""
        with self.devices_lock:
            hmm = self.hmm
            assert hmm is not None
            ids = [d for d, spec in dict(hmm.devices).items() if spec.ray_node_id == ray_node_id]
            hmm.forget_devices(ids)
            self.nodes.mark(ray_node_id, NodeState.LOST, detail=f"devices {ids} lost")
        self.standby.retire_where(lambda inst: ray_node_id in getattr(inst, "nodes", ()))
        self.processes.drop_node(ray_node_id)
        # NOTE: a lost node's machine usually goes with it, but a dead raylet on a live host (or
        # several Ray nodes on one host, as here) leaves its workers' files behind: every live
        # node and this one free the files whose owner is gone (lease-checked, so never a live one's).
        try:
            freed = [*hmm.reap(), *reap(self.config.shm_prefix)]
            if freed:
                logger.info("coordinator: node %s lost; freed %d shared-memory files it left", ray_node_id,
                            len(freed))
        except Exception:  # noqa: BLE001 - the repair matters more than the files
            logger.exception("coordinator: reaping after the loss of node %s failed", ray_node_id)
        return ids

    def lost_nodes(self, dead_device_ids: Iterable[int]) -> set[str]:
        """The nodes of these dead devices' workers that are no longer alive in the Ray cluster."""
        hmm = self.hmm
        if hmm is None:
            return set()
        nodes = {hmm.devices[d].ray_node_id for d in dead_device_ids if d in hmm.devices}
        nodes.discard(None)
        if not nodes:
            return set()
        alive = alive_node_ids()
        return {n for n in nodes if n is not None and n not in alive}

    def release_idle_nodes(self) -> list[str]:
        """Give back the nodes none of whose devices the committed layout uses (never the
        coordinator's own): their devices are unregistered and freed, so Ray's autoscaler may
        reclaim them; the ask for devices is lowered to what the layout uses. With
        `release_idle_nodes` off, only the ask is lowered."""
        hmm = self.hmm
        if hmm is None or hmm.layout is None:
            return []
        layout = hmm.layout
        if self.device_requests.num_asked:
            self.device_requests.ask(len(layout.device_ids))
        if not self.config.release_idle_nodes:
            return []
        by_node: dict[str, list[int]] = collections.defaultdict(list)
        for d, spec in self.usable_devices().items():
            if spec.ray_node_id is not None and spec.ray_node_id != self.home_node:
                by_node[spec.ray_node_id].append(d)
        released = []
        for node, ids in by_node.items():
            if not set(ids) & set(layout.device_ids):
                self.nodes.mark(node, NodeState.RELEASED, detail="idle: no device in use")
                self.remove_node_devices(node)
                released.append(node)
        if released:
            logger.info("coordinator: gave back idle nodes %s", [n[:8] for n in released])
        return released

    @staticmethod
    def rank_nodes(devices: Iterable[DeviceSpec]) -> tuple[str | None, ...]:
        """The Ray node of each rank of an instance on `devices` (rank r uses the r-th)."""
        return tuple(spec.ray_node_id for spec in devices)
