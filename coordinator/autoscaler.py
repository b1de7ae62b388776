"""The SLO-driven autoscaling policy (ElasticMoE §4.3): when to grow or shrink dp by one.

Scale up when SLO attainment stays below `target_attainment` (the paper's 90%)
for `scale_up_after_s`. Scale down when attainment stays at or above
`scale_down_attainment` for `scale_down_after_s` *and* the smaller configuration
is predicted to carry the load: arrivals per rank at dp-1 must stay under
`scale_down_headroom` x the per-rank capacity. The capacity is learned: when a
configuration saturates (the scale-up condition), its completion rate per rank
is what one rank can do; `rank_capacity_rps` may seed it. Until it is known, the
latency headroom stands in for it: p90 TTFT and TPOT must be under
`scale_down_headroom` x their targets.

Never flapping:
- hysteresis: the band between the two attainment thresholds resets both timers;
- persistence: a condition must hold for its whole delay, re-checked every tick;
- cooldown: after a scale finishes, nothing for `cooldown_s`, and the estimator is
  reset so the next decision sees only the new configuration.

A manual scale pauses the policy until it is resumed. `Autoscaler.evaluate` is pure
decision logic on a snapshot and a clock value; `coordinator.autoscale_loop` runs it.
"""

from __future__ import annotations

import collections
import dataclasses
import enum
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

from coordinator.slo import SloSnapshot, SloTargets
from coordinator.strategies import DEFAULT_STRATEGY, STRATEGIES
from elasticmoe.utils.settings import cli


class AutoscaleConfig(BaseModel):
    """`--autoscale-*` flags, the `[autoscale]` table of `--config` and the `autoscale` Serve arg
    (`elasticmoe.utils.settings`). The SLO part applies even when off (it feeds /metrics)."""

    model_config = ConfigDict(frozen=True, extra="forbid", strict=True, hide_input_in_errors=True)

    enabled: bool = Field(False, description="turn the autoscaler on", json_schema_extra=cli("--autoscale"))
    min_dp: int = Field(1, description="smallest dp the autoscaler scales down to")
    max_dp: int | None = Field(None, description="largest dp it scales up to (default: every device)")
    slo_ttft_s: float = Field(1.0, description="SLO target for time to first token, seconds (also on /metrics "
                              "when off)")
    slo_tpot_s: float = Field(0.5, description="SLO target for time per output token after the first, seconds")
    target_attainment: float = Field(0.9, description="scale up when SLO attainment stays below this fraction "
                                     "(the paper's 0.9)")
    scale_down_attainment: float = Field(0.99, description="scale down only while attainment is at least this "
                                         "(the band between the two is hysteresis)")
    window_s: float = Field(20.0, description="sliding window of the SLO estimator, seconds")
    interval_s: float = Field(1.0, description="seconds between decisions")
    scale_up_after_s: float = Field(5.0, description="a violation must persist this long before scaling up")
    scale_down_after_s: float = Field(30.0, description="over-provisioning must persist this long before "
                                      "scaling down")
    cooldown_s: float = Field(30.0, description="no decision for this long after any scale finishes")
    min_samples: int = Field(10, description="finished requests the window needs before attainment counts")
    scale_down_headroom: float = Field(
        0.7, description="scale down only if the load per rank at dp-1 stays under this fraction of a rank's "
        "capacity (or p90 latencies under this fraction of the targets while the capacity is unknown)")
    rank_capacity_rps: float | None = Field(
        None, description="requests/s one rank sustains within the SLO, if known (default: learned when the SLO "
        "is first violated)")
    strategy: str = Field(DEFAULT_STRATEGY, description=f"how the autoscaler scales: one of {', '.join(STRATEGIES)}")

    @model_validator(mode="after")
    def _check(self) -> AutoscaleConfig:
        def fail(option: str, why: str) -> None:
            raise ValueError(f"--autoscale-{option.replace('_', '-')}: {why}")

        if self.min_dp < 1:
            fail("min_dp", f"must be >= 1, got {self.min_dp}")
        if self.max_dp is not None and self.max_dp < self.min_dp:
            fail("max_dp", f"must be >= min_dp ({self.min_dp}), got {self.max_dp}")
        SloTargets(self.slo_ttft_s, self.slo_tpot_s)  # raises for non-positive targets
        if not 0 < self.target_attainment <= self.scale_down_attainment <= 1:
            fail("target_attainment", "need 0 < target_attainment <= scale_down_attainment <= 1, got "
                 f"{self.target_attainment} and {self.scale_down_attainment}")
        for name in ("window_s", "interval_s"):
            if getattr(self, name) <= 0:
                fail(name, f"must be > 0, got {getattr(self, name)}")
        for name in ("scale_up_after_s", "scale_down_after_s", "cooldown_s"):
            if getattr(self, name) < 0:
                fail(name, f"must be >= 0, got {getattr(self, name)}")
        if self.min_samples < 1:
            fail("min_samples", f"must be >= 1, got {self.min_samples}")
        if not 0 < self.scale_down_headroom <= 1:
            fail("scale_down_headroom", f"must be in (0, 1], got {self.scale_down_headroom}")
        if self.rank_capacity_rps is not None and self.rank_capacity_rps <= 0:
            fail("rank_capacity_rps", f"must be > 0, got {self.rank_capacity_rps}")
        if self.strategy not in STRATEGIES:
            fail("strategy", f"must be one of {', '.join(STRATEGIES)}, got {self.strategy!r}")
        return self

    @property
    def targets(self) -> SloTargets:
        return SloTargets(self.slo_ttft_s, self.slo_tpot_s)


class Action(enum.StrEnum):
    SCALE_UP = "scale_up"
    SCALE_DOWN = "scale_down"
    HOLD = "hold"


@dataclasses.dataclass(slots=True)
class Decision:
    """One evaluation: what the policy saw and chose. `outcome` is set once acted upon."""

    at: float  # the policy's clock (monotonic seconds)
    action: Action
    reason: str
    dp: int
    target_dp: int
    inputs: dict[str, Any]
    outcome: str | None = None  # started | rejected | failed (scale actions only)
    event_id: str | None = None
    error: str | None = None

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["action"] = self.action.value
        return d


class Autoscaler:
    """Decides; does not act. The loop reports back with `on_started` / `on_scale_finished`."""

    def __init__(self, config: AutoscaleConfig, num_devices: int, history: int = 100) -> None:
        self.config = config
        self.min_dp = config.min_dp
        self.max_dp = min(config.max_dp or num_devices, num_devices)
        if self.min_dp > self.max_dp:
            raise ValueError(f"--autoscale-min-dp: {self.min_dp} exceeds the {num_devices} devices")
        self.enabled = config.enabled
        self.paused_reason: str | None = None
        self.rank_capacity_rps = config.rank_capacity_rps
        self.desired_dp: int | None = None
        self.last: Decision | None = None  # the latest evaluation, hold or not
        self.decisions: collections.deque[Decision] = collections.deque(maxlen=history)  # scale actions only
        self._up_since: float | None = None
        self._down_since: float | None = None
        self._cooldown_until = float("-inf")

    # ---- control -------------------------------------------------------------------------

    @property
    def is_active(self) -> bool:
        return self.enabled and self.paused_reason is None

    def pause(self, reason: str) -> None:
        """Stop deciding (a manual scale took over) until `resume()`."""
        self.paused_reason = reason
        self._up_since = self._down_since = None

    def resume(self) -> None:
        self.enabled = True
        self.paused_reason = None

    def on_scale_finished(self, now: float, succeeded: bool) -> None:
        """Any scale, manual or ours: restart the cooldown and the persistence timers."""
        self._cooldown_until = now + self.config.cooldown_s
        self._up_since = self._down_since = None
        if not succeeded:
            self.desired_dp = None

    # ---- policy --------------------------------------------------------------------------

    def evaluate(self, now: float, snap: SloSnapshot, dp: int, scale_running: bool) -> Decision:
        cfg = self.config
        inputs = {**snap.to_dict(), "rank_capacity_rps": self.rank_capacity_rps}

        def decide(action: Action, reason: str, target: int | None = None) -> Decision:
            decision = Decision(now, action, reason, dp, dp if target is None else target, inputs)
            self.last = decision
            if action is not Action.HOLD:
                self.decisions.append(decision)
                self.desired_dp = decision.target_dp
            return decision

        if not self.enabled:
            return decide(Action.HOLD, "autoscaling is off")
        if self.paused_reason is not None:
            return decide(Action.HOLD, f"paused: {self.paused_reason}")
        if scale_running:
            return decide(Action.HOLD, "a scale is running")
        if now < self._cooldown_until:
            return decide(Action.HOLD, f"cooldown for {self._cooldown_until - now:.1f} s more")

        enough = snap.num_finished >= cfg.min_samples
        violating = enough and snap.attainment is not None and snap.attainment < cfg.target_attainment
        idle = snap.arrival_rps * snap.window_s < cfg.min_samples and snap.num_finished < cfg.min_samples
        # Low traffic counts as comfortable only once a whole window has been observed.
        high = snap.attainment is None or snap.attainment >= cfg.scale_down_attainment
        comfortable = high and (enough or (idle and snap.window_s >= min(cfg.window_s, cfg.scale_down_after_s)))

        if violating:
            self._down_since = None
            self._up_since = now if self._up_since is None else self._up_since
            held = now - self._up_since
            if held < cfg.scale_up_after_s:
                return decide(Action.HOLD, f"attainment {snap.attainment:.2f} < {cfg.target_attainment} "
                              f"for {held:.1f}/{cfg.scale_up_after_s} s")
            # Saturated: what the ranks completed is what they can do (learned capacity).
            self._learn_capacity(snap.finished_rps / dp)
            if dp >= self.max_dp:
                return decide(Action.HOLD, f"attainment {snap.attainment:.2f} below target at max dp {self.max_dp}")
            self._up_since = None
            return decide(Action.SCALE_UP, f"attainment {snap.attainment:.2f} < {cfg.target_attainment} "
                          f"for {held:.1f} s", dp + 1)

        self._up_since = None
        if not comfortable:
            self._down_since = None
            return decide(Action.HOLD, "within the hysteresis band" if enough else "too few samples")
        if dp <= self.min_dp:
            self._down_since = None
            return decide(Action.HOLD, f"attainment high at min dp {self.min_dp}")
        fits, why = self._smaller_fits(snap, dp)
        if not fits:
            self._down_since = None
            return decide(Action.HOLD, why)
        self._down_since = now if self._down_since is None else self._down_since
        held = now - self._down_since
        if held < cfg.scale_down_after_s:
            return decide(Action.HOLD, f"over-provisioned ({why}) for {held:.1f}/{cfg.scale_down_after_s} s")
        self._down_since = None
        return decide(Action.SCALE_DOWN, f"over-provisioned for {held:.1f} s: {why}", dp - 1)

    def _smaller_fits(self, snap: SloSnapshot, dp: int) -> tuple[bool, str]:
        """Would dp-1 ranks still meet the SLO at the observed load?"""
        cfg = self.config
        per_rank = snap.arrival_rps / (dp - 1)
        if self.rank_capacity_rps is not None:
            limit = cfg.scale_down_headroom * self.rank_capacity_rps
            verdict = "fits" if per_rank <= limit else "would not fit"
            return per_rank <= limit, f"{per_rank:.2f} rps/rank at dp {dp - 1} {verdict} {limit:.2f} (capacity x headroom)"
        ttft_ok = snap.ttft_p90_s is None or snap.ttft_p90_s <= cfg.scale_down_headroom * cfg.slo_ttft_s
        tpot_ok = snap.tpot_p90_s is None or snap.tpot_p90_s <= cfg.scale_down_headroom * cfg.slo_tpot_s
        if ttft_ok and tpot_ok:
            return True, f"capacity unknown; p90 latencies within {cfg.scale_down_headroom:g} x targets"
        return False, f"capacity unknown and p90 latencies above {cfg.scale_down_headroom:g} x targets"

    def _learn_capacity(self, observed_per_rank_rps: float) -> None:
        if observed_per_rank_rps <= 0:
            return
        previous = self.rank_capacity_rps
        # An exponential average: one noisy saturated window must not halve the estimate.
        self.rank_capacity_rps = observed_per_rank_rps if previous is None else 0.5 * previous + 0.5 * observed_per_rank_rps

    def status(self) -> dict[str, Any]:
        return {
            "enabled": self.enabled,
            "paused": self.paused_reason,
            "min_dp": self.min_dp,
            "max_dp": self.max_dp,
            "desired_dp": self.desired_dp,
            "rank_capacity_rps": self.rank_capacity_rps,
            "config": self.config.model_dump(),
            "last_evaluation": None if self.last is None else self.last.to_dict(),
            "decisions": [d.to_dict() for d in self.decisions],
        }
