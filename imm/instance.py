"""`Instance`: the `InstanceRank` actors of one configuration (dp, tp=1, ep=dp) and their EP group.

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
from collections.abc import Mapping, Sequence
from typing import Any

import ray

from elasticmoe.parallel.expert_placement import ExpertPlacement
from hmm.controller import HMMController
from hmm.p2p import GroupSpec
from hmm.providers import Handle
from imm.lifecycle import InstanceState, check_transition
from imm.rank import InstanceRankActor, RankStats
from imm.zero_copy import AttachReport

logger = logging.getLogger(__name__)

S = InstanceState
_ids = itertools.count()


def handles_from_hmm(hmm: Any, dp: int) -> tuple[list[dict[str, Handle]], ExpertPlacement]:
    """The current layout's handle sets and placement from an `HMMController` or its actor."""
    if isinstance(hmm, HMMController):
        layout, sets = hmm.layout, [hmm.handle_set(r) for r in range(dp)]
    else:
        layout = ray.get(hmm.__ray_call__.remote(lambda ctl: ctl.layout))
        sets = ray.get([hmm.handle_set.remote(r) for r in range(dp)])
    if layout is None or layout.dp != dp:
        raise ValueError(f"hmm layout has dp={getattr(layout, 'dp', None)}, instance has dp={dp}")
    return sets, layout.placement


class Instance:
    """One inference instance. Build with `create_standby`; then attach -> warm_up -> activate."""

    def __init__(self, dp: int, model_dir: str, *, timeout_s: float = 120.0) -> None:
        if dp < 1:
            raise ValueError(f"dp: must be >= 1, got {dp}")
        self.instance_id = f"inst{next(_ids)}-dp{dp}"
        self.dp, self.model_dir, self.timeout_s = dp, model_dir, timeout_s
        self.ranks: list[Any] = []
        self.state = S.BOOTING
        self.timings: dict[str, float] = {}
        self.attach_reports: list[AttachReport] = []
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
        cls, model_dir: str, dp: int, engine_options: Mapping[str, Any] | None = None, **kwargs: Any
    ) -> Instance:
        """Start `dp` rank actors, form their EP group, build the skeletons (no weights)."""
        inst = cls(dp, model_dir, **kwargs)
        options = dict(engine_options or {})

        def boot() -> None:
            inst.ranks = [
                InstanceRankActor.options(name=f"{inst.instance_id}-r{r}").remote(r, dp) for r in range(dp)
            ]
            addr, port = inst._get([inst.ranks[0].node_address.remote(), inst.ranks[0].free_port.remote()])
            group = GroupSpec(dp, addr, port, epoch=0)
            inst._get([rank.init_group.remote(group) for rank in inst.ranks])
            inst._get([rank.build_skeleton.remote(model_dir, options) for rank in inst.ranks])

        try:
            inst._transition(S.STANDBY, boot)
        except BaseException:
            inst.retire()
            raise
        return inst

    def attach(self, hmm: Any) -> list[AttachReport]:
        """Attach every rank to the HMM's current layout (see `attach_handles`)."""
        sets, placement = handles_from_hmm(hmm, self.dp)
        return self.attach_handles(sets, placement)

    def attach_handles(self, handle_sets: Sequence[Mapping[str, Handle]], placement: ExpertPlacement) -> list[AttachReport]:
        """Build each rank's engine on its handle set (zero-copy). Raises if any rank copied."""
        if len(handle_sets) != self.dp or placement.num_ranks != self.dp:
            raise ValueError(f"{self}: need {self.dp} handle sets and a {self.dp}-rank placement")

        def work() -> list[AttachReport]:
            refs = [rank.attach.remote(hs, placement) for rank, hs in zip(self.ranks, handle_sets, strict=True)]
            reports: list[AttachReport] = self._get(refs)
            bad = [r for r, rep in enumerate(reports) if not rep.is_zero_copy]
            if bad:
                raise RuntimeError(f"{self}: ranks {bad} did not attach zero-copy: {reports}")
            self.attach_reports = reports
            return reports

        return self._transition(S.ATTACHED, work)

    def warm_up(self) -> list[float]:
        """Start the lockstep loops of all ranks and run one short request through each."""

        def work() -> list[float]:
            self._get([rank.start.remote() for rank in self.ranks])
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

    def retire(self) -> None:
        """Stop the loops, shut the ranks down and kill the actors. Best effort, never leaves actors."""

        def work() -> None:
            try:
                ray.get([rank.shutdown.remote() for rank in self.ranks], timeout=self.timeout_s)
            except Exception:  # noqa: BLE001 - dead or hung ranks are killed below anyway
                logger.exception("%s: shutdown failed; killing the ranks", self.instance_id)
            for rank in self.ranks:
                ray.kill(rank)
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
