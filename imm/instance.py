"""`Instance`: the `InstanceRank` actors of one configuration (dp, tp=1, ep) and their EP group.

With the native backend ep = dp: the ranks split the experts and step in lockstep over one gloo
group. With the vLLM backend ep = 1: the ranks are independent replicas (no group), each holding
every expert (the HMM's replicated layout).

States and legal transitions are in `imm.lifecycle`; every lifecycle method checks
its transition *before* doing any work and moves the state only when the work
succeeded, so an instance never claims a state it has not reached. `retire()`
is allowed from every state but `retired` and always leaves no actor behind.

The methods are synchronous (they block on `ray.get`); an asyncio caller (the
coordinator) runs them in a thread. NOTE: lifecycle calls on one instance are
serialised by a lock; a second concurrent lifecycle call raises instead of
interleaving (e.g. `retire` while `attach` is half-way would leave engines on
half-attached ranks).
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Collection, Mapping, Sequence
from typing import Any

import numpy as np
import ray

from elasticmoe.config import EngineOptions
from elasticmoe.engine.handover import RequestSnapshot
from elasticmoe.errors import describe_error
from elasticmoe.parallel.expert_placement import ExpertPlacement
from hmm.controller import HMMController
from hmm.p2p import GroupSpec
from hmm.placement import on_node
from hmm.providers import Handle
from imm.engine_backend import AttachResult, BackendName
from imm.handover import ImportReport, assign_snapshots
from imm.lifecycle import InstanceState, check_transition
from imm.rank import InstanceRankActor
from imm.rank_processes import RankProcessPool
from imm.rank_stats import RankStats
from imm.vllm_support import rank_env

logger = logging.getLogger(__name__)

S = InstanceState
_ids = itertools.count()


def handles_from_hmm(
    hmm: Any, dp: int, pending: bool = False
) -> tuple[list[dict[str, Handle]], ExpertPlacement, list[int]]:
    """Handle sets, placement and device ids (per rank) of the committed layout, or of the
    pending target (`pending=True`), from an `HMMController` or its actor."""
    if isinstance(hmm, HMMController):
        layout = hmm.layout_of(pending)
        sets = [hmm.handle_set(r, pending) for r in range(dp)]
    else:
        layout = ray.get(hmm.layout_of.remote(pending))
        sets = ray.get([hmm.handle_set.remote(r, pending) for r in range(dp)])
    if layout.dp != dp:
        raise ValueError(f"hmm layout has dp={layout.dp}, instance has dp={dp}")
    return sets, layout.placement, list(layout.device_ids)


def seeds_from_hmm(hmm: Any, devices: Sequence[Any]) -> list[dict[str, Handle] | None]:
    """For standby ranks to be placed on `devices` (`DeviceSpec`s): a handle set of the committed
    layout with the same tensors as each rank's target (ep = 1 layouts only: every replica holds
    the same bytes), on the rank's node (handles open in one host): its own device's if that is in
    the layout, else that of the lowest device id of its node in the layout (scale-downs keep the
    lowest ids); None where no replica is on its node or the layout is not replicated."""
    layout = hmm.layout_of() if isinstance(hmm, HMMController) else ray.get(hmm.layout_of.remote())
    if not layout.is_replicated:
        return [None] * len(devices)
    by_node: dict[int, int] = {}
    for d in sorted(layout.device_ids):
        by_node.setdefault(layout.device(d).node_id, d)
    sources = [d.device_id if d.device_id in layout.device_ids else by_node.get(d.node_id) for d in devices]
    wanted = sorted({s for s in sources if s is not None})
    if isinstance(hmm, HMMController):
        sets = [hmm.handle_set(layout.rank_of(d)) for d in wanted]
    else:
        sets = ray.get([hmm.handle_set.remote(layout.rank_of(d)) for d in wanted])
    found = dict(zip(wanted, sets, strict=True))
    return [found[s] if s is not None else None for s in sources]


class Instance:
    """One inference instance. Build with `create_standby`; then attach -> warm_up -> activate."""

    def __init__(
        self, dp: int, model_dir: str, *, timeout_s: float = 120.0, backend: BackendName = "native"
    ) -> None:
        if dp < 1:
            raise ValueError(f"dp: must be >= 1, got {dp}")
        self.instance_id = f"inst{next(_ids)}-dp{dp}"
        self.dp, self.model_dir, self.timeout_s, self.backend = dp, model_dir, timeout_s, backend
        self.ranks: list[Any] = []
        self.state = S.BOOTING
        self.timings: dict[str, float] = {}
        self.attach_reports: list[AttachResult] = []
        self.device_ids: list[int] = []  # device of each rank, known from attach
        self.nodes: tuple[str | None, ...] = (None,) * dp  # Ray node of each rank (None: anywhere)
        self.is_paused = False
        self.import_reports: list[ImportReport] = []
        self.processes: RankProcessPool | None = None  # where the ranks' processes go at `retire`
        self.num_reused = 0  # ranks that took a retired rank's process instead of starting one
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return f"Instance({self.instance_id}, {self.state.value})"

    def _get(self, refs: Any) -> Any:
        return ray.get(refs, timeout=self.timeout_s)

    def _transition(self, target: InstanceState, work: Any) -> Any:
        """Check `state -> target`, run `work()`, then set the state (only on success)."""
        if not self._lock.acquire(blocking=False):
            raise RuntimeError(f"{self}: another lifecycle call is in progress")
        try:
            check_transition(self.state, target)
            t0 = time.perf_counter()
            result = work()
            self.timings[target.value] = time.perf_counter() - t0
            logger.info("%s -> %s in %.3fs", self.instance_id, target.value, self.timings[target.value])
            self.state = target
            return result
        finally:
            self._lock.release()

    # ---- lifecycle -----------------------------------------------------------------------

    @classmethod
    def create_standby(
        cls,
        model_dir: str,
        dp: int,
        engine_options: EngineOptions | None = None,
        paced: bool = False,
        nodes: Sequence[str | None] = (),
        seeds: Sequence[Mapping[str, Handle] | None] = (),
        processes: RankProcessPool | None = None,
        **kwargs: Any,
    ) -> Instance:
        """Start `dp` rank actors, form their EP group, build the skeletons (no weights).

        `paced`: start the rank processes one after another instead of all at once. A process
        start (interpreter, torch import) takes ~2 CPU-seconds; a background preparation
        of a dp=4 standby would otherwise take every core from the serving instance.
        `nodes`: the Ray node of each rank's device (rank r maps device r's memory, so it runs
        there); empty: anywhere. `seeds`: per rank, a handle set of the committed layout on its node
        holding what its target will hold (a vLLM rank builds its engine on it in standby, see
        `VllmBackend.prepare`; the native backend ignores it); empty: none. `processes`: idle
        processes of retired ranks to take before starting new ones (native backend), and where
        this instance's go when it retires (`imm.rank_processes`).
        """
        if nodes and len(nodes) != dp:
            raise ValueError(f"nodes: one per rank, got {len(nodes)} for dp {dp}")
        if seeds and len(seeds) != dp:
            raise ValueError(f"seeds: one per rank, got {len(seeds)} for dp {dp}")
        inst = cls(dp, model_dir, **kwargs)
        options = engine_options or EngineOptions()
        inst.nodes = tuple(nodes) or (None,) * dp
        inst.processes = processes if inst.backend == "native" else None
        seed_of = list(seeds) or [None] * dp

        if inst.backend == "vllm":  # vLLM runs in the rank's process, with its thread count from the start
            placed_env: dict[str, Any] = {"runtime_env": {"env_vars": rank_env(options.num_threads)}}
        else:
            placed_env = {}

        def reused_rank(r: int) -> Any | None:
            pool = inst.processes
            process = pool.take(inst.nodes[r]) if pool is not None else None
            if pool is None or process is None:
                return None
            try:
                inst._get(process.actor.reuse.remote(r, dp, inst.backend))
            except Exception as exc:  # noqa: BLE001 - never reuse a process that failed: start a new one
                logger.warning("%s: rank process %d not reused (%s)", inst.instance_id, process.pid, describe_error(exc))
                pool.discard(process)
                return None
            inst.num_reused += 1
            return process.actor

        def start_rank(r: int) -> Any:
            reused = reused_rank(r)
            if reused is not None:
                return reused
            placed = on_node(inst.nodes[r])
            rank: Any = InstanceRankActor.options(name=f"{inst.instance_id}-r{r}", **placed, **placed_env).remote(
                r, dp, inst.backend)
            if paced:
                inst._get(rank.node_address.remote())  # returns once the process is up
            return rank

        def boot() -> None:
            inst.ranks = []
            for r in range(dp):  # NOTE: appended one by one, so `retire` reaches every started rank
                inst.ranks.append(start_rank(r))
            addr, port = inst._get([inst.ranks[0].node_address.remote(), inst.ranks[0].free_port.remote()])
            group = GroupSpec(dp, addr, port, epoch=0)
            inst._get([rank.init_group.remote(group) for rank in inst.ranks])
            inst._get([rank.build_skeleton.remote(model_dir, options, seed_of[r]) for r, rank in enumerate(inst.ranks)])

        try:
            inst._transition(S.STANDBY, boot)
        except BaseException:
            inst.retire()
            raise
        return inst

    def attach(
        self, hmm: Any, *, pending: bool = False, fenced_device_ids: Sequence[int] = ()
    ) -> list[AttachResult]:
        """Attach every rank to the HMM's committed layout, or to the pending target between
        `execute` and `commit` (`pending=True`, the scale-up/down path; see `attach_handles`)."""
        sets, placement, device_ids = handles_from_hmm(hmm, self.dp, pending)
        return self.attach_handles(sets, placement, device_ids, fenced_device_ids)

    def attach_handles(
        self,
        handle_sets: Sequence[Mapping[str, Handle]],
        placement: ExpertPlacement,
        device_ids: Sequence[int] | None = None,
        fenced_device_ids: Sequence[int] = (),
    ) -> list[AttachResult]:
        """Give each rank its handle set (weights used in place). Raises if any rank copied what
        its engine keeps as given (vLLM's CPU repacks are copies by design, counted in its report).

        `fenced_device_ids`: devices whose KV pool a serving instance still allocates from;
        the native ranks there hold a `KVFence` until `import_requests` (they skip the warm-up).
        """
        ranks = self.dp if self.backend == "native" else 1  # vLLM replicas: every expert on each
        if len(handle_sets) != self.dp or placement.num_ranks != ranks:
            raise ValueError(f"{self}: need {self.dp} handle sets and a {ranks}-rank placement")
        devices = list(device_ids) if device_ids is not None else list(range(self.dp))
        fenced = [d in set(fenced_device_ids) for d in devices]

        def work() -> list[AttachResult]:
            refs = [
                rank.attach.remote(hs, placement, f)
                for rank, hs, f in zip(self.ranks, handle_sets, fenced, strict=True)
            ]
            reports: list[AttachResult] = self._get(refs)
            bad = [r for r, rep in enumerate(reports) if not rep.is_zero_copy]
            if bad:
                raise RuntimeError(f"{self}: ranks {bad} did not attach zero-copy: {reports}")
            self.attach_reports, self.device_ids = reports, devices
            return reports

        return self._transition(S.ATTACHED, work)

    def warm_up(self) -> list[float]:
        """Start the lockstep loops of all ranks and run one short request through each."""

        def work() -> list[float]:
            self._get([rank.start.remote([p for p in self.ranks if p is not rank]) for rank in self.ranks])
            return self._get([rank.warm_up.remote() for rank in self.ranks])

        return self._transition(S.WARM, work)

    def activate(self) -> None:
        self._transition(S.ACTIVE, lambda: self._get([rank.check_health.remote() for rank in self.ranks]))

    def drain(self, timeout_s: float | None = None, poll_s: float = 0.01) -> bool:
        """Stop taking new requests (the router must check `is_serving`) and wait, up to
        `timeout_s` (None: forever), until in-flight ones finished. Returns True if drained."""
        self._transition(S.DRAINING, lambda: None)
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while any(s.num_running + s.num_waiting for s in self.stats()):
            if deadline is not None and time.monotonic() > deadline:
                return False
            time.sleep(poll_s)
        return True

    # ---- switchover (see `imm.handover` for the splice protocol) -----------------------------

    def pause(self) -> None:
        """active -> draining: every rank's loop stops at one round boundary; streams stay open.

        NOTE: the router must stop sending here before this call: `generate` on a paused
        rank raises `EngineDeadError` (requests that arrived during the pause are exported).
        """

        def work() -> None:
            self._get([rank.pause.remote() for rank in self.ranks])
            self.is_paused = True

        if self.state is S.DRAINING and not self.is_paused:  # drained first, now handing over
            with self._lock:
                work()
        else:
            self._transition(S.DRAINING, work)

    def export_requests(self, hand_over_kv: bool = True) -> dict[int, list[RequestSnapshot]]:
        """After `pause`: device id -> the snapshots of the requests its rank held.

        Each request's stream waits for `route_handed_over`, then ends with a `HandedOverOutput`
        naming the rank that continues it. With `hand_over_kv`
        the blocks stay allocated in the device's pool for the next owner. NOTE: a paused,
        exported instance must only be retired (its engines would allocate from shared pools).
        """
        if not self.is_paused:
            raise RuntimeError(f"{self}: export_requests before pause")
        with self._lock:
            snaps = self._get([rank.export_requests.remote(hand_over_kv) for rank in self.ranks])
        return dict(zip(self.device_ids, snaps, strict=True))

    def reinstate(
        self, snaps_by_device: Mapping[int, Sequence[RequestSnapshot]], kv_kept: bool = True
    ) -> dict[str, Any]:
        """Undo `pause` + `export_requests` (a switchover that failed): every rank runs again and
        takes back the requests it exported (`kv_kept`: exported with `hand_over_kv`, so their KV
        is still in place); back to `active`. Returns request id -> rank actor to `resume` on.
        NOTE: retire the instance they were handed to first."""
        if not self.is_paused:
            raise RuntimeError(f"{self}: reinstate without a pause")

        def work() -> dict[str, Any]:
            snaps = [list(snaps_by_device.get(d, ())) for d in self.device_ids]
            self._get([rank.reinstate.remote(s, kv_kept) for rank, s in zip(self.ranks, snaps, strict=True)])
            self.is_paused = False
            return {s.request_id: rank for rank, ss in zip(self.ranks, snaps, strict=True) for s in ss}

        return self._transition(S.ACTIVE, work)

    def import_requests(
        self,
        snaps_by_device: Mapping[int, Sequence[RequestSnapshot]],
        kv_is_shared: bool = True,
        recompute_devices: Collection[int] = (),
    ) -> dict[str, Any]:
        """Continue the exported requests here; returns request id -> rank actor to `resume` on.

        A request from a device this instance holds continues on that device's rank with its
        KV (no recomputation); the others go to the least-loaded ranks and recompute. Every
        rank receives its shared-KV import (possibly empty) first, which ends its `KVFence`.
        `kv_is_shared=False`: this instance has its own KV pools (a baseline strategy), so
        every request is recomputed; so are those from `recompute_devices` (see `assign_snapshots`).
        NOTE: call only once every old rank exported (it still owns the shared pools before).
        """
        if self.state not in (S.WARM, S.ACTIVE):
            raise RuntimeError(f"{self}: import_requests needs a warm or active instance")
        if self.backend != "native":  # vLLM replicas keep no KV across engines: all recomputed, by load
            kv_is_shared = False
        loads = [s.num_running + s.num_waiting for s in self.stats()]
        plan = assign_snapshots(snaps_by_device, self.device_ids, loads, kv_is_shared, recompute_devices)
        with self._lock:
            reports: list[ImportReport] = self._get(
                [rank.import_requests.remote(plan[r][0], True) for r, rank in enumerate(self.ranks)]
            )
            reports += self._get(
                [rank.import_requests.remote(plan[r][1], False) for r, rank in enumerate(self.ranks) if plan[r][1]]
            )
        self.import_reports = reports
        return {s.request_id: self.ranks[r] for r, (shared, moved) in plan.items() for s in shared + moved}

    def route_handed_over(self, routes: Mapping[str, Any]) -> int:
        """Tell every rank where its exported requests continue (request id -> rank actor, as
        `import_requests` or `reinstate` returned); their streams end with a marker naming it.
        Returns how many streams were routed. NOTE: works in any state but retired: a rank whose
        engine is already released (`release_engines`) still routes its waiting streams."""
        if not routes:
            return 0
        return sum(self._get([rank.route_handed_over.remote(dict(routes)) for rank in self.ranks]))

    def abandon_handover(self, reason: str) -> None:
        """No route will come for the exported requests still waiting (their consumers continue
        them from what their clients received)."""
        self._get([rank.abandon_handover.remote(reason) for rank in self.ranks])

    def wait_resumed(self, request_ids: Collection[str], timeout_s: float) -> set[str]:
        """Wait until every imported request among `request_ids` was resumed on its rank here;
        returns those still unresumed at the timeout (a client that went away)."""
        ids = list(request_ids)
        if not ids:
            return set()
        missing = self._get([rank.wait_resumed.remote(ids, timeout_s) for rank in self.ranks])
        return set().union(*map(set, missing))

    def expert_load(self) -> np.ndarray | None:
        """Tokens routed per (MoE layer, expert) by all ranks, summed (each rank counts its own
        tokens); None when no rank has a native engine."""
        counts = [c for c in self._get([rank.expert_load.remote() for rank in self.ranks]) if c is not None]
        return np.sum(counts, axis=0) if counts else None

    def warm_expert_caches(self, popularity: np.ndarray) -> int:
        """Fill every rank's expert cache with its most used experts (attached, not yet serving);
        returns the rows filled."""
        return sum(self._get([rank.warm_expert_cache.remote(popularity) for rank in self.ranks]))

    def release_engines(self) -> None:
        """Drop every rank's engine (its device memory mappings and EP group) but keep the rank
        processes, so the streams of their exported requests can still be routed. For a switchover
        that must free the old instance's memory before the new one exists (`cold_restart`)."""
        if not self.is_paused:
            raise RuntimeError(f"{self}: release_engines before pause")
        self._get([rank.shutdown.remote() for rank in self.ranks])

    def retire(self, wait_dead_s: float = 0.0) -> None:
        """Stop the loops, shut the ranks down and kill the actors, or, if every rank shut down
        cleanly, give their processes to `processes` (each rank's engine is gone then: it stopped
        its loop and dropped its device memory). Best effort, never leaves an actor of this instance.

        `wait_dead_s` > 0: also wait (up to that long) until every killed rank process is gone, for
        a caller that hands their KV pools to another instance (a hung rank must not write there)."""

        # A dying instance's ranks are killed soon anyway: do not wait long for their orderly shutdown.
        shutdown_timeout_s = min(self.timeout_s, 2.0) if wait_dead_s else self.timeout_s

        def work() -> None:
            clean = False
            try:
                ray.get([rank.shutdown.remote() for rank in self.ranks], timeout=shutdown_timeout_s)
                clean = True
            except Exception as exc:  # noqa: BLE001 - dead or hung ranks are killed below anyway
                logger.warning("%s: shutdown failed (%s); killing the ranks", self.instance_id, describe_error(exc))
            if clean and self.processes is not None:
                kept = self.processes.give(self.ranks)  # kills those it does not keep
                killed = [rank for rank, k in zip(self.ranks, kept, strict=True) if not k]
            else:
                killed = self.ranks
                for rank in killed:
                    ray.kill(rank)
            if wait_dead_s:
                _wait_dead(killed, wait_dead_s)
            self.ranks = []

        self._transition(S.RETIRED, work)

    # ---- serving helpers ---------------------------------------------------------------

    @property
    def is_serving(self) -> bool:
        return self.state is S.ACTIVE

    def stats(self) -> list[RankStats]:
        return self._get([rank.stats.remote() for rank in self.ranks])

    def least_loaded_rank(self) -> int:
        """DP rank with the fewest running + waiting requests (KV usage breaks ties, then rank)."""
        if self.state not in (S.WARM, S.ACTIVE):
            raise RuntimeError(f"{self}: not serving")
        return min(self.stats(), key=lambda s: (*s.load, s.rank)).rank

    def check_health(self) -> None:
        self._get([rank.check_health.remote() for rank in self.ranks])


def _wait_dead(actors: Sequence[Any], timeout_s: float) -> None:
    """Return once every actor is gone (a call on it raises `RayActorError`), or after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    alive = list(actors)
    while alive and time.monotonic() < deadline:
        still = []
        for actor in alive:
            try:
                ray.get(actor.__ray_ready__.remote(), timeout=0.5)
                still.append(actor)
            except ray.exceptions.RayActorError:
                pass
            except ray.exceptions.GetTimeoutError:
                still.append(actor)
        alive = still
        if alive:
            time.sleep(0.05)
    if alive:
        logger.warning("%d rank processes still alive %.0f s after being killed", len(alive), timeout_s)
