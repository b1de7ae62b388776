"""Runs the autoscaling policy in the coordinator: tick, act, record, export.

Every `interval_s` the loop takes an `SloTracker` snapshot, asks the `Autoscaler`
for a decision and, for a scale action, starts a scale through the same path as
`POST /admin/scale` (so the same validation and 409s apply). The outcome is kept
on the decision (`/admin/status` and `/admin/autoscaler`) and counted in
`elasticmoe_autoscaler_decisions_total{action, outcome}`.

Scale events finish on the scale thread; `on_scale_finished` hops to the loop's
thread, where the tracker lives, before resetting it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge

from coordinator.autoscaler import Action, Autoscaler, Decision
from coordinator.scale_events import ScaleEvent, ScaleState
from coordinator.slo import SloTracker
from elasticmoe.entrypoints.openai.errors import OpenAIError

logger = logging.getLogger(__name__)

StartScale = Callable[[int, str], str]  # (dp, strategy) -> event id; raises OpenAIError


class AutoscaleLoop:
    def __init__(
        self,
        policy: Autoscaler,
        tracker: SloTracker,
        start_scale: StartScale,
        active_dp: Callable[[], int | None],
        scale_running: Callable[[], bool],
        registry: CollectorRegistry,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.policy = policy
        self.tracker = tracker
        self.start_scale = start_scale
        self.active_dp = active_dp
        self.scale_running = scale_running
        self.clock = clock
        self._task: asyncio.Task[None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self.decisions_counter = _register_metrics(registry, self)

    # ---- running -------------------------------------------------------------------------

    def start(self) -> None:
        """Start ticking on the running event loop (idempotent)."""
        self._loop = asyncio.get_running_loop()
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name="autoscaler")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.policy.config.interval_s)
            try:
                self.tick()
            except Exception:  # noqa: BLE001 - a policy bug must not kill the loop (or the server)
                logger.exception("autoscaler tick failed")

    def tick(self) -> Decision | None:
        """One evaluation (and action). None while no instance serves."""
        dp = self.active_dp()
        if dp is None:
            return None
        decision = self.policy.evaluate(self.clock(), self.tracker.snapshot(), dp, self.scale_running())
        if decision.action is Action.HOLD:
            return decision
        try:
            decision.event_id = self.start_scale(decision.target_dp, self.policy.config.strategy)
            decision.outcome = "started"
            logger.info("autoscaler: %s dp %d -> %d (%s), event %s", decision.action.value, dp,
                        decision.target_dp, decision.reason, decision.event_id)
        except OpenAIError as exc:
            decision.outcome = "rejected" if exc.status_code < 500 else "failed"
            decision.error = exc.message
            self.policy.desired_dp = None
            logger.warning("autoscaler: %s to dp %d %s: %s", decision.action.value, decision.target_dp,
                           decision.outcome, exc.message)
        self.decisions_counter.labels(decision.action.value, decision.outcome).inc()
        return decision

    # ---- scale events --------------------------------------------------------------------

    def on_scale_finished(self, event: ScaleEvent) -> None:
        """From any thread: restart cooldown and observation for the configuration now serving."""

        def apply() -> None:
            self.policy.on_scale_finished(self.clock(), event.state is ScaleState.SUCCEEDED)
            self.tracker.reset()

        loop = self._loop
        if loop is None or loop.is_closed():
            apply()
            return
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is loop:
            apply()
        else:
            loop.call_soon_threadsafe(apply)


def _register_metrics(registry: CollectorRegistry, loop: AutoscaleLoop) -> Counter:
    """The SLO estimator's and the policy's gauges; returns the decisions counter."""

    def attainment() -> float:
        value = loop.tracker.snapshot().attainment
        return math.nan if value is None else value

    policy, targets = loop.policy, loop.tracker.targets
    Gauge("elasticmoe_slo_attainment_ratio",
          "Fraction of requests finished in the sliding window that met both the TTFT and TPOT targets "
          "(NaN with none).", registry=registry).set_function(attainment)
    Gauge("elasticmoe_slo_ttft_target_seconds", "The TTFT target of the SLO.",
          registry=registry).set(targets.ttft_s)
    Gauge("elasticmoe_slo_tpot_target_seconds", "The TPOT target of the SLO.",
          registry=registry).set(targets.tpot_s)
    Gauge("elasticmoe_load_rps", "Requests arriving per second over the sliding window.",
          registry=registry).set_function(lambda: loop.tracker.snapshot().arrival_rps)
    Gauge("elasticmoe_autoscaler_enabled", "1 while the autoscaler decides (enabled and not paused), else 0.",
          registry=registry).set_function(lambda: float(policy.is_active))
    Gauge("elasticmoe_autoscaler_desired_dp",
          "The dp the autoscaler last asked for (the active dp when it has not asked).",
          registry=registry).set_function(lambda: float(policy.desired_dp or loop.active_dp() or 0))
    counter = Counter("elasticmoe_autoscaler_decisions",
                      "Scale decisions of the autoscaler by action (scale_up, scale_down) and outcome "
                      "(started, rejected, failed).", ["action", "outcome"], registry=registry)
    for action in (Action.SCALE_UP, Action.SCALE_DOWN):
        for outcome in ("started", "rejected", "failed"):
            counter.labels(action.value, outcome)  # exported at 0 from the start (dashboards, rate())
    return counter
