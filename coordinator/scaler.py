"""`Scaler`: change the active instance's DP/EP degree while it keeps serving (ElasticMoE §5.2).

One scale, in order (strategy `elastic`):

1. prepare, concurrently (two threads): the HMM plans and executes the target layout
   (old mappings stay valid), and the IMM provides a standby instance of the target dp
   (from the pre-initialised pool, else booted now);
2. attach the new instance to the HMM's *pending* handle sets (KV fenced on the devices
   the old instance still allocates from) and warm it up;
3. critical section: new requests held at the ingress (`hold_requests`) -> old paused
   at a round boundary -> its requests exported -> imported by the new instance -> each
   exported stream told its new rank (it ends with a marker naming it; the ingress
   resumes the request there) -> the new instance published -> requests released;
4. activate the new instance, retire the old once the handed-over requests were resumed,
   `hmm.commit()` (frees what the target does not hold), refill the standby pool in the
   background.

The baselines and ablations (`coordinator.strategies`) switch HMM mechanisms off,
skip the pool, put the target on fresh devices, or (`cold_restart`) tear the old
instance's engines down first and reload from disk with requests held throughout.

Rollback (event `rolled_back`): a failure before the pause retires the new instance and
`hmm.abort()` restores the old layout exactly; the old one never stopped serving. A failure
in the critical section (pause, export, import) is undone too: the new instance is retired,
the old one runs again and takes back the requests it exported (their KV never left its
pools), their streams resume there, then `hmm.abort()`. Requests reaching an old rank after
its pause are turned away (`RankPaused`) and routed again by the ingress once the next state
is published. Only if that undo fails, or a
`cold_restart` fails after tearing the old instance down, does the event end `failed`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import ray
from ray.exceptions import ActorUnavailableError, RayActorError

from coordinator.scale_events import ScaleConflict, ScaleEvent
from coordinator.strategies import DEFAULT_STRATEGY, ScaleStrategy, strategy
from elasticmoe.engine.async_llm import EngineDeadError
from elasticmoe.engine.handover import RequestSnapshot
from elasticmoe.errors import describe_error, unwrap_remote
from hmm.expert_moves import load_imbalance
from hmm.planner import TargetConfig
from imm.instance import Instance
from imm.lifecycle import InstanceState

if TYPE_CHECKING:
    from coordinator.cluster import ClusterManager

logger = logging.getLogger(__name__)

HEAL = "heal"  # the strategy name of a scale nobody asked for: replacing what failed
DRAIN = "drain"  # the strategy name of a scale that moves the model off a node being drained
_OWN_REASONS = (HEAL, DRAIN)  # events that run with the default mechanisms
_SWAP_WAIT_S = 120.0  # how long a scale waits for an adapter being swapped out (its requests finish)


@dataclass(frozen=True, slots=True)
class Repair:
    """What a heal replaces (see `Scaler.heal`)."""

    fault: str  # what was detected, for the event and the logs
    old_is_dead: bool  # its ranks cannot pause or export: their requests resume from the clients' side
    recompute_devices: frozenset[int] = frozenset()  # its KV pool there is not the HMM's (a restored device)
    detected_at: float | None = None  # epoch seconds


def is_instance_death(exc: BaseException) -> bool:
    """`exc` (from a call on an instance's ranks) means a rank is gone or its step loop ended."""
    original = unwrap_remote(exc)
    return isinstance(original, RayActorError | ActorUnavailableError | EngineDeadError)


class NoCapacity(RuntimeError):
    """No registered device is left to put an instance on (every node that offered one is gone)."""


class SwitchoverRolledBack(RuntimeError):
    """The switchover failed and was undone: the old instance serves every request again."""


class Scaler:
    """Scales `cluster`'s active instance; one scale at a time (`ScaleEvents` enforces it)."""

    def __init__(self, cluster: ClusterManager) -> None:
        self.cluster = cluster
        self._exported: list[str] = []  # request ids the running scale exported from the old instance

    def validate(self, target_dp: int, strategy_name: str = DEFAULT_STRATEGY) -> int:
        """The current dp; raises `ValueError` naming "dp" or "strategy" for an impossible scale.
        A scale may need more devices than are registered, up to `max_devices` (it asks Ray's
        autoscaler for the rest, `ClusterManager.acquire_devices`)."""
        hmm, old, cfg = self.cluster.hmm, self.cluster.active, self.cluster.config
        if hmm is None or old is None or not old.is_serving:
            raise RuntimeError("scale: no active instance")
        strat = strategy(strategy_name)
        if isinstance(target_dp, bool) or not isinstance(target_dp, int) or target_dp < 1:
            raise ValueError(f"dp: must be an integer >= 1, got {target_dp!r}")
        usable = len(self.cluster.usable_devices())
        limit = max(usable, cfg.max_devices or 0)
        needed = target_dp + (old.dp if strat.placement == "fresh_devices" else 0)
        if needed > limit:
            beyond = f" (--max-devices {cfg.max_devices})" if cfg.max_devices else ""
            what = (f"strategy {strat.name} needs {target_dp} devices the active instance does not use and"
                    if strat.placement == "fresh_devices" else f"{target_dp} ranks need {target_dp} devices,")
            raise ValueError(f"dp: {what} only {usable} are registered{beyond}")
        if target_dp == old.dp:
            raise ValueError(f"dp: the active instance already has dp={target_dp}")
        return old.dp

    def start(self, target_dp: int, strategy_name: str = DEFAULT_STRATEGY, lock_wait_s: float = 0.0) -> ScaleEvent:
        """Validate and register the event (409 `ScaleConflict` while one runs, or while an
        adapter is being loaded or unloaded); `run` does the work. An adapter registration or
        swap step holds the adapter lock for a moment: the scale waits up to `lock_wait_s` for
        it (blocking; 0 from the event loop, whose caller retries later)."""
        running = self.cluster.scale_events.running
        if running is not None:  # NOTE: first: mid-switchover no instance is "serving" (that would be a 503)
            raise ScaleConflict(running.event_id)
        from_dp = self.validate(target_dp, strategy_name)
        adapters = self.cluster.adapters
        if not adapters.lock.acquire(timeout=lock_wait_s):  # timeout 0: one try
            raise ScaleConflict(None, "cannot scale while an adapter is being loaded or unloaded")
        try:  # NOTE: under the adapter lock: an adapter load checks for a running scale under it
            busy = adapters.busy_reason()
            if busy is not None:
                raise ScaleConflict(None, f"cannot scale while {busy}")
            return self.cluster.scale_events.start(from_dp, target_dp, strategy_name)
        finally:
            adapters.lock.release()

    def scale(self, target_dp: int, strategy_name: str = DEFAULT_STRATEGY) -> ScaleEvent:
        """Blocking: start and run a scale to `target_dp`; returns the finished event."""
        event = self.start(target_dp, strategy_name)
        self.run(event)
        return event

    def heal(self, repair: Repair) -> ScaleEvent:
        """Replace the active instance after a fault (blocking; the outcome is on the returned
        event, strategy `heal`). The target is a standby instance of the same dp if the pool has
        one, else a pooled neighbour (dp+1 while a device is free, else dp-1) reached by the same
        HMM transition as a scale, else a new instance of the same dp booted now. Raises
        `ScaleConflict` while a scale runs (its own switchover handles an old instance that died)."""
        old = self.cluster.active
        if old is None:
            raise RuntimeError("heal: no instance to replace")
        event = self.cluster.scale_events.start(old.dp, self._heal_dp(old.dp), HEAL)
        event.fault, event.detected_at = repair.fault, repair.detected_at
        self.run(event, repair)
        return event

    def _heal_dp(self, dp: int) -> int:
        """The same dp if the pool has it, else a pooled neighbour, else the same dp booted now; at
        most the devices left (a lost node takes its devices). `NoCapacity` when none is left."""
        pooled = set(self.cluster.standby.pool)
        num_devices = len(self.cluster.usable_devices())
        if num_devices < 1:
            raise NoCapacity("no device is left to serve on; waiting for nodes to join")
        for candidate in (dp, dp + 1, dp - 1):
            if candidate in pooled and 1 <= candidate <= num_devices:
                return candidate
        return min(dp, num_devices)

    def move_off(self, reason: str) -> ScaleEvent:
        """Scale the active instance off the devices that are leaving (a node being drained: see
        `ClusterManager.usable_devices`) with the default mechanisms, blocking; the same dp if
        enough devices stay, else as many as stay. The outcome is on the returned event (strategy
        `drain`). Raises `ScaleConflict` while another scale runs, `NoCapacity` if none would stay."""
        old = self.cluster.active
        if old is None or not old.is_serving:
            raise RuntimeError("drain: no active instance")
        num_devices = len(self.cluster.usable_devices())
        if num_devices < 1:
            raise NoCapacity("no device would be left to serve on")
        event = self.cluster.scale_events.start(old.dp, min(old.dp, num_devices), DRAIN)
        event.fault = reason
        self.run(event)
        return event

    def run(self, event: ScaleEvent, repair: Repair | None = None) -> None:
        """Run a started event to its end; never raises (the outcome is on the event). The standby
        pool is refilled after every outcome, so the next scale finds it warm."""
        rolled_back = True
        error: str | None = "interrupted"
        try:
            with self.cluster.devices_lock:  # no device joins in the middle of a scale
                error = self._run(event, repair)
        except BaseException as exc:  # noqa: BLE001 - recorded on the event
            logger.exception("scale %s failed", event.event_id)
            error, rolled_back = describe_error(exc), False
        finally:
            if error is None:  # nodes the new layout does not use may go back to Ray's autoscaler
                try:
                    self.cluster.release_idle_nodes()
                except Exception:  # noqa: BLE001 - they stay registered; nothing else depends on it
                    logger.exception("scale %s: giving back idle nodes failed", event.event_id)
            self.cluster.prepare_standby(self.cluster.config.standby_delay_s)
        self.cluster.scale_events.finish(event, error, rolled_back)
        logger.info("scale %s: %s", event.event_id, event.to_dict())

    def _run(self, event: ScaleEvent, repair: Repair | None) -> str | None:
        cluster, t0 = self.cluster, time.perf_counter()
        hmm, old = cluster.hmm, cluster.active
        assert hmm is not None and old is not None
        strat = strategy(DEFAULT_STRATEGY if event.strategy in _OWN_REASONS else event.strategy)
        if repair is None:
            # An adapter swap under way finishes first (none starts now): its victim's requests
            # must not be handed over to an instance that does not admit them.
            busy = cluster.adapters.wait_swaps(_SWAP_WAIT_S)
            if busy is not None:
                return f"rolled back before switchover: {busy}"
            needed = event.to_dp + (old.dp if strat.placement == "fresh_devices" else 0)
            try:
                cluster.acquire_devices(needed, cluster.config.device_wait_s)
            except TimeoutError as exc:
                cluster.release_idle_nodes()  # lower the ask again
                return f"rolled back before switchover: {exc}"
        hmm.reset_peak()
        if strat.placement == "stop_first":
            self._cold_restart(event, old, t0)
        elif repair is not None and repair.old_is_dead:
            self._replace_dead(event, old, strat, t0)
        else:
            recompute = repair.recompute_devices if repair is not None else frozenset()
            fenced = [d for d in old.device_ids if d not in recompute] if strat.hands_over_kv else []
            new, max_model_len = self._prepare(event, strat, fenced)
            if new is None:
                return f"rolled back before switchover: {max_model_len}"
            try:
                self._switch_over(event, old, new, int(max_model_len), strat.hands_over_kv, recompute)
            except SwitchoverRolledBack as exc:
                hmm.abort()
                return f"rolled back at switchover: {exc}"
            self._finish(event, new, t0)
            if old.state is not InstanceState.RETIRED:
                self._retire_after_markers(old, new)
            hmm.commit()
        event.peak_memory_bytes = sum(u.peak for u in hmm.usage().values())
        return None

    def _replace_dead(self, event: ScaleEvent, old: Instance, strat: ScaleStrategy, t0: float) -> None:
        """Heal: the old instance died (a rank or its loop). New requests are held from now; the
        old ranks are killed (none may write a KV pool the new ranks will use), the new instance
        is prepared on the HMM's pools and takes the traffic. The requests that ran on the old one
        continue there (the ingress resumes them). If preparing fails, the event is failed and the
        watcher tries again; requests wait for it (up to the engine client's `recovery_wait_s`)."""
        t_close = time.perf_counter()
        self.cluster.hold_requests()
        try:
            if old.state is not InstanceState.RETIRED:  # else a failed repair before this one retired it
                old.retire(wait_dead_s=10.0)
            new, max_model_len = self._prepare(event, strat, fenced=())
            if new is None:
                # NOTE: the dead ranks stay published: requests wait for the next attempt
                # (`RouterEngineClient` waits until they are replaced) instead of failing now.
                raise RuntimeError(f"no replacement instance: {max_model_len}")
            self.cluster.publish(new, int(max_model_len))
            self._finish(event, new, t0)
        finally:
            self.cluster.release_requests()
            event.downtime_s = time.perf_counter() - t_close
        assert self.cluster.hmm is not None
        self.cluster.hmm.commit()

    def _standby(self, target: TargetConfig, strat: ScaleStrategy) -> Instance:
        cfg, nodes = self.cluster.config, self.cluster.rank_nodes(target.devices)

        def boot_now(n: int) -> Instance:  # all ranks at once: the scale is waiting for it
            return self.cluster.create_instance(n, target.devices)

        if strat.preinit and cfg.standby_pool:
            # NOTE: a pooled instance was placed for the layout of its preparation; its ranks must
            # sit on the nodes of this scale's devices (they map their memory).
            inst = self.cluster.standby.take(target.dp, factory=boot_now, fits=lambda i: i.nodes == nodes)
            assert isinstance(inst, Instance)
            return inst
        return boot_now(target.dp)

    def _prepare(
        self, event: ScaleEvent, strat: ScaleStrategy, fenced: Sequence[int]
    ) -> tuple[Instance | None, int | str]:
        """HMM transition || standby instance, then attach + warm-up: (new instance, its
        max_model_len), or (None, error) after rolling back (the old instance never stopped).
        `fenced`: devices whose KV pool the old instance still allocates from (shared with the
        new one until the handover)."""
        hmm, old = self.cluster.hmm, self.cluster.active
        assert hmm is not None and old is not None
        new: Instance | None = None
        try:
            load = self._expert_load(event, old)
            target = self.cluster.target(event.to_dp, fresh_devices=strat.placement == "fresh_devices",
                                         expert_load=load.sum(axis=0) if load is not None else None)
            with ThreadPoolExecutor(2, thread_name_prefix="scale-prep") as pool:
                staged = pool.submit(lambda: hmm.execute(hmm.plan(target, strat.transition)))
                booted = pool.submit(self._standby, target, strat)
                # NOTE: wait for both before acting on either: an instance that booted while the
                # HMM failed must still be retired, and the HMM aborted only once execute returned.
                errors = [f.exception() for f in (staged, booted)]
                if booted.exception() is None:
                    new = booted.result()
                if any(errors):
                    raise next(e for e in errors if e is not None)
                event.bytes_moved = staged.result()
            if load is not None:
                placement = hmm.layout_of(pending=True).placement
                event.expert_load_imbalance = round(load_imbalance(placement, load.sum(axis=0)), 3)
            assert new is not None
            new.attach(hmm, pending=True, fenced_device_ids=fenced)
            self.cluster.adapters.prepare_instance(new)  # the pending layout carries their rows
            if load is not None:
                self._warm_expert_caches(event, new, load)
            new.warm_up()
            return new, min(ray.get([r.max_model_len.remote() for r in new.ranks]))
        except BaseException as exc:
            logger.exception("scale %s: preparation failed; rolling back", event.event_id)
            try:
                hmm.abort()
            except Exception:  # noqa: BLE001 - a dead worker cannot abort; the new instance must still go
                logger.exception("scale %s: aborting the HMM's plan failed", event.event_id)
            if new is not None and new.state is not InstanceState.RETIRED:
                new.retire()
            return None, describe_error(exc)

    def _expert_load(self, event: ScaleEvent, old: Instance) -> np.ndarray | None:
        """Tokens the old instance routed per (MoE layer, expert): the expected load the target
        placement balances (ElasticMoE's load-imbalance point) and the order the new expert caches
        fill in. Best effort: None (count-balanced placement, caches filled on demand) when the
        old instance cannot say, or has routed nothing yet."""
        try:
            load = old.expert_load()
        except Exception as exc:  # noqa: BLE001 - an optimisation; a dead rank is the healer's business
            logger.warning("scale %s: no expert load from the old instance (%s); placing by count", event.event_id,
                           exc)
            return None
        return load if load is not None and load.sum() > 0 else None

    def _warm_expert_caches(self, event: ScaleEvent, new: Instance, load: np.ndarray) -> None:
        """With offloading: the new ranks' caches start with the experts the old instance used
        most, so a scale-down leaves the least needed in the host tier (a scale-up brings the rest
        back, copied by the HMM's plan). Best effort: a failure means the caches fill on demand."""
        if not self.cluster.config.offloads_experts:
            return
        try:
            event.expert_rows_warmed = new.warm_expert_caches(load)
        except Exception:  # noqa: BLE001 - an optimisation; the rank loads on demand
            logger.exception("scale %s: warming the new expert caches failed; they fill on demand", event.event_id)

    def _finish(self, event: ScaleEvent, new: Instance, t0: float) -> None:
        """The new instance, published in the critical section, is active."""
        new.activate()
        event.scale_latency_s = time.perf_counter() - t0

    def _cold_restart(self, event: ScaleEvent, old: Instance, t0: float) -> None:
        """Baseline: requests held, old instance stopped and its engines released (their memory
        mappings dropped), the model unloaded and loaded again from disk at the target dp, a new
        instance booted on it; the requests that were in flight are recomputed there. Requests are
        held throughout (downtime).

        NOTE: a failure after the old instance is gone leaves no instance serving (503s
        until the next scale or restart): the baseline has nothing to roll back to. Its exported
        requests then fail over from their clients' side.
        """
        cluster = self.cluster
        hmm = cluster.hmm
        assert hmm is not None
        t_close = time.perf_counter()
        cluster.hold_requests()
        routed = False
        try:
            old.pause()
            snaps = old.export_requests(hand_over_kv=False)
            event.requests_in_flight = sum(len(s) for s in snaps.values())
            self._exported = [s.request_id for ss in snaps.values() for s in ss]
            old.release_engines()  # NOTE: its processes stay until their streams are routed
            hmm.unload()
            event.bytes_moved = cluster.load_model(event.to_dp)
            assert hmm.layout is not None
            new = cluster.create_instance(event.to_dp, hmm.layout.devices)
            new.attach(hmm)
            cluster.adapters.prepare_instance(new)  # `load` mapped the registered adapters again
            new.warm_up()
            routes = new.import_requests(snaps, kv_is_shared=False)
            event.requests_handed_over = old.route_handed_over(routes)
            routed = True
            cluster.publish(new, min(ray.get([r.max_model_len.remote() for r in new.ranks])))
            self._finish(event, new, t0)
        finally:
            if not routed and old.state is not InstanceState.RETIRED:
                try:
                    old.abandon_handover("the cold restart failed")
                except Exception:  # noqa: BLE001 - retiring it fails the streams all the same
                    logger.warning("scale %s: abandoning the old instance's handover failed", event.event_id)
                old.retire()
            cluster.release_requests()
            event.downtime_s = time.perf_counter() - t_close
        self._retire_after_markers(old, new)

    def _switch_over(
        self,
        event: ScaleEvent,
        old: Instance,
        new: Instance,
        max_model_len: int,
        hand_over_kv: bool,
        recompute_devices: frozenset[int] = frozenset(),
    ) -> None:
        """The critical section: from holding new requests to releasing them to the new ranks.

        Raises `SwitchoverRolledBack` after a failure it undid: the new instance retired, the
        old one running again with every request it had (streams resume there); any other
        error means the undo failed too. If the old instance cannot pause or export (a rank died,
        its loop is stuck), the scale finishes on the new one instead: the old ranks are killed
        and their requests continue on the new instance from what their clients received.
        """
        # NOTE: the ingress learns of the hold asynchronously: a request routed to `old` just
        # before reaches it either before the pause (then it is exported with the others) or
        # after (`RankPaused`: the ingress routes it again once the next state is published).
        t_close = time.perf_counter()
        self.cluster.hold_requests()
        snaps: dict[int, list[RequestSnapshot]] | None = None
        try:
            try:
                old.pause()
                snaps = old.export_requests(hand_over_kv=hand_over_kv)
            except Exception as exc:  # noqa: BLE001 - dead, stuck or broken: it cannot take its requests back either
                logger.warning("scale %s: the old instance failed at the switchover (%s); finishing on the new one",
                               event.event_id, describe_error(exc))
                event.fault = f"old instance failed at the switchover: {describe_error(exc)}"
                event.detected_at = time.time()
                # NOTE: its streams fail with its ranks; their consumers continue from what they got.
                old.retire(wait_dead_s=10.0)  # none of its ranks may write a KV pool the new ranks share
                new.import_requests({}, kv_is_shared=True)  # nothing to import: this lifts the KV fences
                self.cluster.publish(new, max_model_len)
                return
            event.requests_in_flight = sum(len(s) for s in snaps.values())
            self._exported = [s.request_id for ss in snaps.values() for s in ss]
            routes = new.import_requests(snaps, kv_is_shared=hand_over_kv, recompute_devices=recompute_devices)
            event.requests_handed_over = len(routes)
            # NOTE: the exported streams wait for these: each ends with a marker naming its new rank.
            old.route_handed_over(routes)
            self.cluster.publish(new, max_model_len)
        except BaseException as exc:
            logger.exception("scale %s: switchover failed; handing the requests back", event.event_id)
            self._undo_switchover(old, new, snaps, hand_over_kv)
            raise SwitchoverRolledBack(describe_error(exc)) from exc
        finally:
            # NOTE: after a failed undo requests are released to `old`'s ranks, which answer with
            # errors (503s) instead of holding requests forever.
            self.cluster.release_requests()
            event.downtime_s = time.perf_counter() - t_close

    def _retire_after_markers(self, old: Instance, new: Instance, timeout_s: float = 10.0) -> None:
        """Retire `old` once the consumers of its exported requests resumed them on `new` (they
        read the markers, so every output before them arrived: a rank killed earlier may take
        undelivered outputs with it, which their clients would then recompute)."""
        try:
            missing = new.wait_resumed(self._exported, timeout_s)
        except Exception as exc:  # noqa: BLE001 - the new instance failing is the healer's business
            missing = set(self._exported)
            logger.warning("waiting for the handed-over requests failed (%s)", describe_error(exc))
        if missing:
            logger.warning("retiring %s: %d handed-over streams not resumed after %.0f s (clients gone?)",
                           old, len(missing), timeout_s)
        self._exported = []
        old.retire()

    def _undo_switchover(
        self, old: Instance, new: Instance, snaps: dict[int, list[RequestSnapshot]] | None, kv_kept: bool
    ) -> None:
        # NOTE: retire the new instance first: on kept devices it shares the old KV pools and may
        # already be stepping imported requests; the old one must be their only writer again.
        new.retire()
        self._exported = []
        if old.is_paused:
            old.route_handed_over(old.reinstate(snaps or {}, kv_kept))  # their streams resume on `old`
