"""`Scaler`: change the active instance's DP/EP degree while it keeps serving (ElasticMoE §5.2).

One scale, in order:

1. prepare, concurrently (two threads): the HMM plans and executes the target layout
   (old mappings stay valid), and the IMM boots a standby instance of the target dp;
2. attach the new instance to the HMM's *pending* handle sets (KV fenced on the devices
   the old instance still allocates from) and warm it up;
3. critical section: gate closed -> old paused at a round boundary -> its requests
   exported -> imported by the new instance -> handover routes published (the engine
   client resumes each stream there) -> router points at the new ranks -> gate open;
4. activate the new instance, retire the old, `hmm.commit()` (frees what the target
   does not hold).

Any failure before the pause rolls back: `hmm.abort()` restores the old layout exactly,
the new instance is retired and the old one never stopped serving (event `rolled_back`).
A failure after the pause is not rolled back (README: not there yet); it is logged and
recorded on the event.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING

import ray

from coordinator.scale_events import ScaleEvent
from hmm.planner import scale_target
from imm.handover import HandoverRoutes
from imm.instance import Instance
from imm.lifecycle import InstanceState

if TYPE_CHECKING:
    from coordinator.cluster import ClusterManager

logger = logging.getLogger(__name__)

STRATEGY = "elastic"
# Runs a router call on the thread that owns the router's asyncio loop and waits for it.
LoopCaller = Callable[[Callable[[], None]], None]


def _call_here(fn: Callable[[], None]) -> None:
    fn()


class Scaler:
    """Scales `cluster`'s active instance; one scale at a time (`ScaleEvents` enforces it)."""

    def __init__(
        self,
        cluster: ClusterManager,
        routes: HandoverRoutes,
        call_on_loop: LoopCaller = _call_here,
        on_activated: Callable[[int], None] | None = None,
    ) -> None:
        self.cluster = cluster
        self.routes = routes
        self.call_on_loop = call_on_loop
        self.on_activated = on_activated  # gets the new instance's max_model_len

    def validate(self, target_dp: int) -> int:
        """The current dp; raises `ValueError` naming "dp" for an impossible target."""
        hmm, old = self.cluster.hmm, self.cluster.active
        if hmm is None or old is None or not old.is_serving:
            raise RuntimeError("scale: no active instance")
        if isinstance(target_dp, bool) or not isinstance(target_dp, int) or target_dp < 1:
            raise ValueError(f"dp: must be an integer >= 1, got {target_dp!r}")
        if target_dp > len(hmm.devices):
            raise ValueError(
                f"dp: {target_dp} ranks need {target_dp} devices, only {len(hmm.devices)} registered"
            )
        if target_dp == old.dp:
            raise ValueError(f"dp: the active instance already has dp={target_dp}")
        return old.dp

    def start(self, target_dp: int) -> ScaleEvent:
        """Validate and register the event (409 `ScaleConflict` while one runs); `run` does the work."""
        from_dp = self.validate(target_dp)
        return self.cluster.scale_events.start(from_dp, target_dp, STRATEGY)

    def scale(self, target_dp: int) -> ScaleEvent:
        """Blocking: start and run a scale to `target_dp`; returns the finished event."""
        event = self.start(target_dp)
        self.run(event)
        return event

    def run(self, event: ScaleEvent) -> None:
        """Run a started event to its end; never raises (the outcome is on the event)."""
        try:
            error = self._run(event)
        except BaseException as exc:  # noqa: BLE001 - recorded on the event
            logger.exception("scale %s failed", event.event_id)
            error = f"{type(exc).__name__}: {exc}"
        self.cluster.scale_events.finish(event, error)
        logger.info("scale %s: %s", event.event_id, event.to_dict())

    def _run(self, event: ScaleEvent) -> str | None:
        cluster, t0 = self.cluster, time.perf_counter()
        hmm, old = cluster.hmm, cluster.active
        assert hmm is not None and old is not None
        cfg, layout = cluster.config, hmm.layout
        assert layout is not None
        hmm.reset_peak()
        new_devices = [spec for d, spec in sorted(hmm.devices.items()) if d not in layout.device_ids]
        target = scale_target(layout, event.to_dp, new_devices, kv_bytes=cfg.kv_bytes_per_device)

        new: Instance | None = None
        try:
            with ThreadPoolExecutor(2, thread_name_prefix="scale-prep") as pool:
                staged = pool.submit(lambda: hmm.execute(hmm.plan(target)))
                booted = pool.submit(
                    Instance.create_standby, cfg.model_dir, event.to_dp, engine_options=cfg.engine_options()
                )
                # NOTE: wait for both before acting on either: an instance that booted while the
                # HMM failed must still be retired, and the HMM aborted only once execute returned.
                errors = [f.exception() for f in (staged, booted)]
                if booted.exception() is None:
                    new = booted.result()
                if any(errors):
                    raise next(e for e in errors if e is not None)
            assert new is not None
            new.attach(hmm, pending=True, fenced_device_ids=old.device_ids)
            new.warm_up()
            max_model_len = min(ray.get([r.max_model_len.remote() for r in new.ranks]))
        except BaseException as exc:
            logger.exception("scale %s: preparation failed; rolling back", event.event_id)
            hmm.abort()
            if new is not None and new.state is not InstanceState.RETIRED:
                new.retire()
            return f"rolled back before switchover: {type(exc).__name__}: {exc}"

        self._switch_over(event, old, new)
        cluster.active, cluster.max_model_len = new, max_model_len
        if self.on_activated is not None:
            self.on_activated(max_model_len)
        new.activate()
        event.scale_latency_s = time.perf_counter() - t0
        old.retire()
        hmm.commit()
        usage = hmm.usage()
        event.peak_memory_bytes = sum(u.peak for u in usage.values())
        return None

    def _switch_over(self, event: ScaleEvent, old: Instance, new: Instance) -> None:
        """The critical section: from closing the gate to reopening it on the new ranks."""
        router = self.cluster.router
        # NOTE: close the gate on the router's loop: once it returns, every request that got a
        # rank of `old` has submitted its `generate`, so `old.pause()`'s export includes it.
        t_close = time.perf_counter()
        self.call_on_loop(router.close_gate)
        try:
            old.pause()
            snaps = old.export_requests(hand_over_kv=True)
            event.requests_in_flight = sum(len(s) for s in snaps.values())
            routes = new.import_requests(snaps)
            event.requests_handed_over = len(routes)
            # NOTE: publish before opening the gate; consumers of `old`'s streams block on these.
            self.routes.publish(routes)
            self.call_on_loop(lambda: router.set_active(new.ranks))
        finally:
            # NOTE: after a failure here the gate still reopens on `old`'s ranks, which answer
            # with errors (503s) instead of holding requests forever; rollback is not supported.
            self.call_on_loop(router.open_gate)
            event.downtime_s = time.perf_counter() - t_close


def loop_caller(loop: asyncio.AbstractEventLoop, timeout_s: float = 30.0) -> LoopCaller:
    """A `LoopCaller` for a router owned by `loop` (asyncio objects are not thread-safe)."""

    def call(fn: Callable[[], None]) -> None:
        async def run() -> None:
            fn()

        asyncio.run_coroutine_threadsafe(run(), loop).result(timeout=timeout_s)

    return call
