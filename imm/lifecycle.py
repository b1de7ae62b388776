"""Instance states and their legal transitions (paper §4.5: pre-initialised standby instances).

    booting -> standby -> attached -> warm -> active -> draining -> retired

- booting:  rank processes starting, EP group forming, skeleton being built.
- standby:  processes up, config + tokenizer loaded, group formed; no weights, no KV.
- attached: engines built on HMM handles (zero-copy); step loops not serving yet.
- warm:     step loops running, one warm-up request went through every rank.
- active:   the router sends it traffic (at most one active instance per model).
- draining: no new requests; in-flight ones finish (or are handed over); a paused
            instance whose switchover rolled back goes back to active.
- retired:  loops stopped, actors gone. Terminal.

Any non-terminal state may also go to `retired` (failure, eviction, rollback);
everything else not listed below raises `IllegalTransition`.
"""

from __future__ import annotations

import enum


class InstanceState(enum.Enum):
    BOOTING = "booting"
    STANDBY = "standby"
    ATTACHED = "attached"
    WARM = "warm"
    ACTIVE = "active"
    DRAINING = "draining"
    RETIRED = "retired"


_NEXT: dict[InstanceState, frozenset[InstanceState]] = {
    InstanceState.BOOTING: frozenset({InstanceState.STANDBY}),
    InstanceState.STANDBY: frozenset({InstanceState.ATTACHED}),
    InstanceState.ATTACHED: frozenset({InstanceState.WARM}),
    InstanceState.WARM: frozenset({InstanceState.ACTIVE}),
    InstanceState.ACTIVE: frozenset({InstanceState.DRAINING}),
    InstanceState.DRAINING: frozenset({InstanceState.ACTIVE}),
    InstanceState.RETIRED: frozenset(),
}


class IllegalTransition(RuntimeError):
    """A lifecycle call that the instance's current state does not allow."""

    def __init__(self, current: InstanceState, target: InstanceState) -> None:
        super().__init__(f"instance cannot go from {current.value} to {target.value}")
        self.current, self.target = current, target


def can_transition(current: InstanceState, target: InstanceState) -> bool:
    if current is InstanceState.RETIRED:
        return False
    return target is InstanceState.RETIRED or target in _NEXT[current]


def check_transition(current: InstanceState, target: InstanceState) -> None:
    """Raise `IllegalTransition` unless `current -> target` is allowed."""
    if not can_transition(current, target):
        raise IllegalTransition(current, target)
