"""`Healer`: watches the active instance's ranks and the HMM's device workers, and repairs what died.

A failure is a scale event nobody asked for (DESIGN.md): the repair runs through the scaler,
one at a time with the scales, and is recorded as a scale event of strategy `heal`.

- A rank dies, stops answering, or its step loop ends (a peer of its EP group died, its
  engine crashed): the instance is replaced (`Scaler.heal`, old instance dead). The requests
  that ran on it continue on the new instance from what their clients received (the engine
  client resumes them), so a client sees a pause, not an error.
- A node dies (its raylet and everything on it): its devices are forgotten, and the instance
  is replaced on the surviving devices (`Scaler.heal`: the HMM re-plans from what survives,
  experts only the lost devices held read from disk); with no device left, nothing is
  published to route to (requests get 503 at once, never hang) until a node joins.
- A device worker dies: a new worker takes its place and its tensors are restored
  (`HMMController.restore_device`: p2p from a replica, else disk) before anything needs
  them; then the active instance, whose rank on that device still maps the dead worker's
  memory, is switched over to a fresh one (`Scaler.heal`, old instance alive: requests are
  handed over, those on that device recomputed), which frees that memory.

Detection: a probe every `interval_s` (each rank's `check_health`, each worker's, with a
timeout), and at once when a stream sees its rank fail (`notify`). A rank that does not
answer `max_unanswered` probes in a row counts as dead; a device worker only when it is
gone (it is busy for seconds during a scale's copies, and a slow worker breaks nothing).
While a scale runs the healer only watches: the scale's own switchover finishes on the new
instance if the old one dies, and anything left is repaired right after it.

`faults` says what is degraded now (replaced as a whole: any thread may read it); every
change is published to the ingress with the routing state (`ClusterManager.publish_health`):
`/ready` is 503 while the active instance is broken, `/health` lists the faults and turns
503 only after `max_failed_repairs` repairs in a row failed (then only a restart helps).
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import ray
from ray.exceptions import GetTimeoutError, RayActorError

from coordinator.routing_state import Health
from coordinator.scale_events import ScaleConflict, ScaleState
from coordinator.scaler import NoCapacity, Repair, Scaler, is_instance_death
from elasticmoe.errors import describe_error

if TYPE_CHECKING:
    from coordinator.cluster import ClusterManager

logger = logging.getLogger(__name__)

INSTANCE = "instance"  # the key of an instance fault in `Healer.faults`


@dataclass(frozen=True, slots=True)
class Probe:
    """One look at the cluster: what is dead now."""

    dead_ranks: tuple[int, ...]  # DP ranks of the active instance
    unanswered_ranks: tuple[int, ...]  # ranks that did not answer in time
    dead_devices: tuple[int, ...]
    detail: str


class Healer:
    def __init__(
        self,
        cluster: ClusterManager,
        scaler: Scaler,
        *,
        interval_s: float = 0.5,
        probe_timeout_s: float = 2.0,
        max_unanswered: int = 3,
        max_failed_repairs: int = 5,
    ) -> None:
        self.cluster, self.scaler = cluster, scaler
        self.interval_s, self.probe_timeout_s = interval_s, probe_timeout_s
        self.max_unanswered, self.max_failed_repairs = max_unanswered, max_failed_repairs
        self._faults: dict[str, str] = {}  # component -> what is wrong ("instance", "device 1")
        self._num_failed_repairs = 0  # in a row
        self.num_repairs: dict[tuple[str, str], int] = {}  # (fault kind, outcome) -> count
        self._unanswered = 0
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # ---- lifecycle -----------------------------------------------------------------------

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="healer", daemon=True)
            self._thread.start()

    def stop(self, timeout_s: float = 30.0) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout_s)

    @property
    def faults(self) -> dict[str, str]:
        return self._faults

    @faults.setter
    def faults(self, faults: dict[str, str]) -> None:
        self._faults = faults
        self._publish()

    @property
    def num_failed_repairs(self) -> int:
        return self._num_failed_repairs

    @num_failed_repairs.setter
    def num_failed_repairs(self, n: int) -> None:
        self._num_failed_repairs = n
        self._publish()

    def _publish(self) -> None:
        self.cluster.publish_health(Health.of(self.is_broken, self._faults, self.has_given_up))

    def notify(self, rank: Any = None) -> None:
        """A stream saw `rank` fail: look now instead of at the next interval (any thread)."""
        self._wake.set()

    @property
    def is_broken(self) -> bool:
        """The active instance cannot serve until it is replaced."""
        return INSTANCE in self.faults

    @property
    def is_serving(self) -> bool:
        """What `/ready` says: an instance serves and it is not known to be broken."""
        return self.cluster.is_ready and not self.is_broken

    @property
    def has_given_up(self) -> bool:
        return self.num_failed_repairs >= self.max_failed_repairs

    # ---- the loop ------------------------------------------------------------------------

    def _run(self) -> None:
        while not self._stop.is_set():
            self._wake.wait(self.interval_s)
            self._wake.clear()
            if self._stop.is_set():
                return
            try:
                self.check_once()
            except Exception:  # noqa: BLE001 - the watcher must outlive anything it watches
                logger.exception("healer: a check failed")

    def check_once(self) -> None:
        """Probe, publish what is dead, and repair it (blocking). While a scale runs only the
        probe: the scale owns the instances and its switchover finishes on the new one if the
        old one died; what is left is repaired once it is over."""
        cluster = self.cluster
        if cluster.is_shut_down or cluster.active is None or cluster.hmm is None:
            return
        scaling = cluster.scale_events.running is not None
        probe = self.probe()
        detected_at = time.time()
        faults = {f"device {d}": "worker died" for d in probe.dead_devices}
        self._unanswered = self._unanswered + 1 if probe.unanswered_ranks else 0
        # Not serving and no scale running: a repair before this one failed half-way.
        not_serving = not cluster.active.is_serving and not scaling
        instance_dead = bool(probe.dead_ranks) or self._unanswered >= self.max_unanswered or not_serving
        if instance_dead:
            faults[INSTANCE] = probe.detail or f"no instance serves ({cluster.active})"
        self.faults = faults
        if scaling or cluster.scale_events.running is not None:
            return
        lost_nodes = cluster.lost_nodes(probe.dead_devices)
        if lost_nodes:
            self._forget_nodes(lost_nodes)
            instance_dead = True  # it had a rank there, or will be re-planned off its devices anyway
            self.faults = {**self.faults, INSTANCE: f"nodes {sorted(n[:8] for n in lost_nodes)} lost"}
        for device_id in probe.dead_devices:
            if cluster.hmm is not None and device_id in cluster.hmm.devices:  # not forgotten with its node
                self._repair_device(device_id, instance_dead, detected_at)
        if instance_dead and INSTANCE in self.faults:
            what = f"nodes lost: {sorted(n[:8] for n in lost_nodes)}" if lost_nodes else f"rank failure: {probe.detail}"
            self._repair(Repair(what, old_is_dead=True, detected_at=detected_at),
                         kind="node" if lost_nodes else "rank")

    def _forget_nodes(self, nodes: set[str]) -> None:
        for node in sorted(nodes):
            ids = self.cluster.forget_lost_node(node)
            logger.warning("healer: node %s is gone with devices %s", node[:8], ids)
            self._count("node", "lost")

    def probe(self) -> Probe:
        """Which ranks of the active instance and which device workers are dead now."""
        cluster = self.cluster
        inst, hmm = cluster.active, cluster.hmm
        dead_ranks: list[int] = []
        unanswered: list[int] = []
        details: list[str] = []
        if inst is not None and inst.ranks:
            refs = [rank.check_health.remote() for rank in inst.ranks]
            ready, _ = ray.wait(refs, num_returns=len(refs), timeout=self.probe_timeout_s)
            for r, ref in enumerate(refs):
                if ref not in ready:
                    unanswered.append(r)
                    continue
                try:
                    ray.get(ref)
                except Exception as exc:  # noqa: BLE001 - any failure of the probe is the rank's
                    if is_instance_death(exc):
                        dead_ranks.append(r)
                        details.append(f"rank {r}: {describe_error(exc)}")
                    else:
                        unanswered.append(r)
        if unanswered and not dead_ranks:
            details.append(f"ranks {unanswered} did not answer within {self.probe_timeout_s:g}s")
        dead_devices = []
        if hmm is not None:
            workers = dict(hmm.workers)
            worker_refs = {d: w.check_health.remote() for d, w in workers.items()}
            done, _ = ray.wait(list(worker_refs.values()), num_returns=len(worker_refs), timeout=self.probe_timeout_s)
            for d, ref in worker_refs.items():
                if ref not in done:
                    continue  # busy (copies during a scale) is not dead
                try:
                    ray.get(ref)
                except RayActorError:
                    dead_devices.append(d)
                except GetTimeoutError:
                    pass
        return Probe(tuple(dead_ranks), tuple(unanswered), tuple(dead_devices), "; ".join(details))

    # ---- repairs -------------------------------------------------------------------------

    def _repair_device(self, device_id: int, instance_dead: bool, detected_at: float) -> None:
        hmm = self.cluster.hmm
        assert hmm is not None
        logger.warning("healer: device %d's worker died; restoring it", device_id)
        try:
            hmm.restore_device(device_id)
        except Exception as exc:  # noqa: BLE001 - counted; tried again at the next probe
            self._count("device", "failed")
            self.num_failed_repairs += 1
            logger.exception("healer: restoring device %d failed", device_id)
            self.faults = {**self.faults, f"device {device_id}": f"restore failed: {describe_error(exc)}"}
            return
        self.faults = {k: v for k, v in self.faults.items() if k != f"device {device_id}"}
        inst = self.cluster.active
        if not instance_dead and inst is not None and device_id in inst.device_ids:
            # Its rank there still maps the dead worker's memory (and a KV pool the HMM no longer
            # has): move the instance onto the restored tensors, recomputing that device's requests.
            self._repair(Repair(f"device {device_id} worker died", old_is_dead=False,
                                recompute_devices=frozenset({device_id}), detected_at=detected_at), kind="device")
        else:
            self._count("device", "succeeded")
            self.num_failed_repairs = 0

    def _repair(self, repair: Repair, kind: str) -> None:
        logger.warning("healer: replacing the active instance (%s)", repair.fault)
        try:
            event = self.scaler.heal(repair)
        except ScaleConflict:
            return  # a scale started meanwhile; it owns the instances now
        except NoCapacity as exc:
            # Nothing to route to: requests get 503 at once instead of waiting for a repair that
            # cannot come; the next probe tries again (a node may have joined).
            self.cluster.withdraw()
            self.faults = {**self.faults, INSTANCE: f"no capacity: {exc}"}
            self._count(kind, "no_capacity")
            return
        outcome = event.state.value
        self._count(kind, outcome)
        if event.state is ScaleState.SUCCEEDED:
            self.num_failed_repairs = 0
            self._unanswered = 0
            self.faults = {k: v for k, v in self.faults.items() if k != INSTANCE}
            logger.warning("healer: %s repaired in %.2fs", repair.fault, event.scale_latency_s or 0.0)
        else:
            self.num_failed_repairs += 1
            logger.error("healer: repairing %s failed (%s); trying again", repair.fault, event.error)
            self._wake.set()

    def _count(self, kind: str, outcome: str) -> None:
        key = (kind, outcome)
        self.num_repairs = {**self.num_repairs, key: self.num_repairs.get(key, 0) + 1}

    def status(self) -> dict[str, Any]:
        return {
            "faults": dict(self.faults),
            "failed_repairs_in_a_row": self.num_failed_repairs,
            "repairs": [{"fault": k, "outcome": o, "count": n} for (k, o), n in sorted(self.num_repairs.items())],
        }
