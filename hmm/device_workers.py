"""`DeviceWorkers`: the set of device workers under the HMM (start, stop, lose, replace, the gloo group).

One worker per registered device owns that device's memory: a `DeviceWorkerActor` on the
device's node (it takes the node's `elasticmoe_device`), or with `use_ray=False` a `DeviceWorker`
in this process (fast path only, no gloo group). With Ray the workers copy between them over one
gloo group (`GroupSpec`), formed again, with the next epoch, whenever the set changes (D.6). Every
call to a worker goes through `_call` / `_gather`, so one code path drives actors and in-process
workers. `HMMController` extends this registry with the layout the workers hold.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any, Literal

import ray

from hmm.device_memory import DEVICE_PAGE_SIZE
from hmm.layout import DeviceSpec
from hmm.memory.segments import DEFAULT_PREFIX
from hmm.p2p import GroupSpec
from hmm.placement import on_node
from hmm.worker import DeviceWorker, DeviceWorkerActor

logger = logging.getLogger(__name__)

P2PMode = Literal["auto", "gloo", "fast"]


class DeviceWorkers:
    """The registered devices (`devices`), their workers (`workers`) and, with Ray, their gloo
    group (`group`). Invariant: `devices` and `workers` have the same ids; the group's ranks are
    the devices in registration order (`_rank`).

    `use_ray=False` keeps workers in this process (fast path only, no gloo group).
    """

    def __init__(
        self,
        *,
        use_ray: bool = True,
        p2p: P2PMode = "auto",
        page_size: int = DEVICE_PAGE_SIZE,
        prefix: str = DEFAULT_PREFIX,
    ) -> None:
        if not use_ray and p2p == "gloo":
            raise ValueError("p2p='gloo' needs Ray workers (one process per device)")
        self.use_ray, self.p2p, self.page_size, self.prefix = use_ray, p2p, page_size, prefix
        self.devices: dict[int, DeviceSpec] = {}
        self.workers: dict[int, Any] = {}
        self.group: GroupSpec | None = None

    # ---- calls to workers ------------------------------------------------------------

    def _call(self, device_id: int, method: str, *args: Any) -> Any:
        return self._call_on(self.workers[device_id], method, *args)

    def _call_on(self, worker: Any, method: str, *args: Any) -> Any:
        fn = getattr(worker, method)
        return fn.remote(*args) if self.use_ray else fn(*args)

    def _gather(self, calls: list[Any]) -> list[Any]:
        return ray.get(calls) if self.use_ray else calls

    def _all(self, device_ids: Sequence[int], method: str, *args: Any) -> list[Any]:
        return self._gather([self._call(d, method, *args) for d in device_ids])

    # ---- registry --------------------------------------------------------------------

    def add_device(self, spec: DeviceSpec) -> None:
        """Start the device's worker; with Ray, rebuild the p2p group to include it (D.6)."""
        self.add_devices([spec])

    def add_devices(self, specs: Sequence[DeviceSpec]) -> None:
        """Start the devices' workers side by side, then (with Ray) rebuild the p2p group once to
        include them all (D.6). One at a time, each worker's start (an interpreter importing
        torch, ~2 CPU-s) and each group rebuild came after the previous: 6 of a 3-device
        server's 9 s start. Ids are checked before any worker starts; if a worker fails to start
        or to join the group, the batch's workers are stopped and unregistered (the devices
        registered before stay, in a group of their own again) and the error is raised."""
        ids = [spec.device_id for spec in specs]
        taken = sorted({d for d in ids if d in self.devices} | {d for d in ids if ids.count(d) > 1})
        if taken:
            raise ValueError(f"devices {taken} are already registered (or given twice)")
        started: list[int] = []
        try:
            for spec in specs:
                self.devices[spec.device_id], self.workers[spec.device_id] = spec, self._start_worker(spec)
                started.append(spec.device_id)
            if specs and self._uses_group:
                self._rebuild_group()
        except BaseException:
            logger.exception("hmm: devices %s did not start; stopping them", ids)
            self._drop_started(started)
            raise

    def _drop_started(self, device_ids: Sequence[int], timeout_s: float = 10.0) -> None:
        """Stop and unregister workers of a batch that failed (best effort: one that cannot shut
        down is killed; its files are reaped with the prefix's); the group again of the rest."""
        for d in device_ids:
            del self.devices[d]
            try:
                self._stop_worker(self.workers.pop(d), timeout_s)
            except Exception:  # noqa: BLE001 - the worker may be what failed
                logger.warning("hmm: device %d did not shut down cleanly", d, exc_info=True)
        if device_ids and self.devices and self._uses_group:
            try:
                self._rebuild_group()
            except Exception:  # noqa: BLE001 - the batch's error is the one raised
                logger.exception("hmm: the p2p group of devices %s could not be formed again", list(self.devices))

    def _start_worker(self, spec: DeviceSpec) -> Any:
        """The device's worker: a Ray actor on its node (its start runs on while this returns), or in process."""
        if self.use_ray:
            return DeviceWorkerActor.options(**on_node(spec.ray_node_id, device=True)).remote(
                spec, self.page_size, self.prefix)
        return DeviceWorker(spec, self.page_size, self.prefix)

    @property
    def _uses_group(self) -> bool:
        """The workers copy between them over a gloo group (Ray workers, not the fast path only)."""
        return self.use_ray and self.p2p != "fast"

    def _stop_worker(self, worker: Any, timeout_s: float | None = None) -> None:
        """The worker frees its memory and ends; a Ray actor is killed even if that fails."""
        try:
            if self.use_ray:
                ray.get(worker.shutdown.remote(), timeout=timeout_s)
            else:
                worker.shutdown()
        finally:
            if self.use_ray:
                ray.kill(worker)

    def remove_device(self, device_id: int) -> None:
        """Unregister a device: its worker frees its memory and exits, which returns its
        `elasticmoe_device` to the node; the p2p group is rebuilt without it."""
        if device_id not in self.devices:
            raise ValueError(f"hmm: device {device_id} is not registered")
        del self.devices[device_id]
        self._stop_worker(self.workers.pop(device_id))
        if self._uses_group and self.devices:
            self._rebuild_group()
        logger.info("hmm: device %d removed", device_id)

    def forget_devices(self, device_ids: Sequence[int]) -> None:
        """Unregister devices that are gone with their memory (their node died): no call reaches
        them; the p2p group is rebuilt of the rest."""
        gone = [d for d in device_ids if d in self.devices]
        if not gone:
            return
        for d in gone:
            del self.devices[d]
            worker = self.workers.pop(d)
            if self.use_ray:
                ray.kill(worker)
        if self._uses_group and self.devices:
            self._rebuild_group()
        logger.warning("hmm: devices %s lost", gone)

    def _replace_worker(self, device_id: int) -> None:
        """A new worker for registered device `device_id` (its worker dead, or to be replaced), in
        the p2p group. The new worker frees what the old one left in /dev/shm (`lease.reap`)."""
        if self.use_ray:
            ray.kill(self.workers[device_id])  # it may be hung rather than dead: it must not free anything now
        self.workers[device_id] = self._start_worker(self.devices[device_id])
        if self._uses_group:
            self._rebuild_group()

    def reap(self) -> list[str]:
        """Free, on every node with a device, the /dev/shm files whose owner process is gone."""
        by_node = {spec.node_id: d for d, spec in self.devices.items()}
        return [name for names in self._all(list(by_node.values()), "reap") for name in names]

    def _rebuild_group(self) -> None:
        ids = list(self.devices)
        # NOTE: every worker answers first: one that failed to start raises here, before the others
        # wait in a group it never joins (the join's gloo timeout is 60 s).
        addr = self._all(ids, "node_address")[0]
        (port,) = self._gather([self._call(ids[0], "free_port")])
        epoch = self.group.epoch + 1 if self.group else 0
        self.group = GroupSpec(len(ids), addr, port, epoch)
        self._gather([self._call(d, "join_group", self.group, rank) for rank, d in enumerate(ids)])

    def _rank(self, device_id: int) -> int:
        return list(self.devices).index(device_id)

    def worker(self, device_id: int) -> Any:
        return self.workers[device_id]

    def shutdown(self) -> None:
        """Free all device memory and stop the workers. A dead worker does not stop the others'
        shutdown (its files are reaped: `reap`, `lease.reap`)."""
        calls = [self._call(d, "shutdown") for d in self.devices]
        for d, call in zip(list(self.devices), calls, strict=True):
            try:
                self._gather([call])
            except Exception:  # noqa: BLE001
                logger.warning("hmm: device %d did not shut down cleanly", d, exc_info=True)
        if self.use_ray:
            for w in self.workers.values():
                ray.kill(w)
        self.workers.clear()
        self.devices.clear()
