"""Which resident nodes to evict when something must be loaded: CoServe's two-stage eviction
(§4.3) and the baselines it is measured against (§5.1: LRU as in Samba-CoE, FIFO).

Every policy is an order over the evictable nodes of a `TierView` (a snapshot of one memory
tier); `select_victims` takes that order's shortest prefix that frees enough. Policies are
pure and registered by name (`EVICTION_POLICIES`, `eviction_policy`).

- **coserve** (two-stage): stage 1, the stranded successors (no predecessor resident: they
  cannot run before something else is loaded), largest footprint first, "to minimise the number
  of experts evicted"; stage 2, every other node by pre-assessed usage probability, ascending
  (ties: larger footprint, then least recently used).
- **lru**: least recently used first (Samba-CoE's replacement).
- **fifo**: loaded earliest first (the "Samba-CoE FIFO" baseline).

Common to all (the engine's invariants, not a policy choice): `pinned` nodes are never evicted
(running requests use them, or the node being loaded needs them resident beside it), and
`queued` nodes (requests are waiting for them in the scheduling window, arranged to run next)
go only after every other node, in the policy's order.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Protocol

from elasticmoe.adapter_policy.graph import DependencyGraph, Node
from elasticmoe.adapter_policy.usage import usage_probabilities


@dataclass(frozen=True, slots=True)
class Residency:
    """When a resident node entered the tier and was last used, as sequence numbers of one
    monotonic counter (earlier events have smaller numbers)."""

    loaded_seq: int
    used_seq: int

    def __post_init__(self) -> None:
        if self.used_seq < self.loaded_seq:
            raise ValueError(f"residency: used_seq {self.used_seq} precedes loaded_seq {self.loaded_seq}")


@dataclass(frozen=True, slots=True)
class TierView:
    """One tier at the moment of an eviction decision.

    Invariant: every resident, pinned or queued name is a node of `graph`; probabilities are in
    [0, 1] (a node without one counts as 0).
    """

    graph: DependencyGraph
    resident: Mapping[str, Residency]
    probabilities: Mapping[str, float] = field(default_factory=dict)
    pinned: frozenset[str] = frozenset()
    queued: frozenset[str] = frozenset()

    def __post_init__(self) -> None:
        for what, names in (("resident", self.resident), ("pinned", self.pinned), ("queued", self.queued)):
            unknown = sorted(n for n in names if n not in self.graph)
            if unknown:
                raise ValueError(f"tier view: {what} names unknown nodes {unknown}")
        bad = {n: p for n, p in self.probabilities.items() if not 0.0 <= p <= 1.0}
        if bad:
            raise ValueError(f"tier view: probabilities outside [0, 1]: {bad}")

    @property
    def evictable(self) -> list[str]:
        """Resident and not pinned, in name order."""
        return sorted(n for n in self.resident if n not in self.pinned)

    def probability(self, name: str) -> float:
        return self.probabilities.get(name, 0.0)


class EvictionPolicy(Protocol):
    @property
    def name(self) -> str:
        """The registry key (the `adapter_eviction` option)."""
        ...

    def order(self, view: TierView, names: list[str]) -> list[str]:
        """`names` (evictable nodes of `view`) in the order this policy evicts them."""
        ...


@dataclass(frozen=True, slots=True)
class TwoStageEviction:
    """CoServe §4.3: stranded successors by footprint, descending; then the rest by usage
    probability, ascending."""

    name: str = "coserve"

    def order(self, view: TierView, names: list[str]) -> list[str]:
        g, resident = view.graph, view.resident
        stage1 = [n for n in names if g.is_stranded(n, resident)]
        # Equal footprints (one slot each): the less probable one first.
        stage1.sort(key=lambda n: (-g.footprint(n), view.probability(n), n))
        chosen = set(stage1)
        stage2 = [n for n in names if n not in chosen]
        stage2.sort(key=lambda n: (view.probability(n), -g.footprint(n), resident[n].used_seq, n))
        return stage1 + stage2


@dataclass(frozen=True, slots=True)
class LruEviction:
    """Least recently used first (Samba-CoE)."""

    name: str = "lru"

    def order(self, view: TierView, names: list[str]) -> list[str]:
        return sorted(names, key=lambda n: (view.resident[n].used_seq, view.resident[n].loaded_seq, n))


@dataclass(frozen=True, slots=True)
class FifoEviction:
    """First loaded, first evicted (the Samba-CoE FIFO baseline)."""

    name: str = "fifo"

    def order(self, view: TierView, names: list[str]) -> list[str]:
        return sorted(names, key=lambda n: (view.resident[n].loaded_seq, n))


EVICTION_POLICIES: dict[str, EvictionPolicy] = {
    p.name: p for p in (TwoStageEviction(), LruEviction(), FifoEviction())
}


def eviction_policy(name: str) -> EvictionPolicy:
    """The registered policy `name`; `ValueError` naming `adapter_eviction` otherwise."""
    if name not in EVICTION_POLICIES:
        raise ValueError(f"adapter_eviction: expected one of {sorted(EVICTION_POLICIES)}, got {name!r}")
    return EVICTION_POLICIES[name]


def slot_tier_view(
    names: list[str],
    loaded_seq: Mapping[str, int],
    used_seq: Mapping[str, int],
    num_requested: Mapping[str, int],
    profiled: Mapping[str, float],
    declared: Mapping[str, float],
    pinned: frozenset[str] = frozenset(),
    queued: frozenset[str] = frozenset(),
) -> TierView:
    """The ESFT slots as a tier: independent nodes of one slot each, residency from the sequence
    numbers (0 if unknown, used no earlier than loaded), usage probabilities from the profile,
    else the declaration, else each one's share of the requests counted. `pinned` / `queued`
    keep only the resident names."""
    graph = DependencyGraph.build(Node(n, "esft", 1) for n in names)
    total = sum(num_requested.get(n, 0) for n in names)
    observed = {n: num_requested.get(n, 0) / total for n in names} if total else {}
    resident = {n: Residency(loaded_seq.get(n, 0), max(used_seq.get(n, 0), loaded_seq.get(n, 0))) for n in names}
    return TierView(graph, resident, usage_probabilities(names, profiled, declared, observed),
                    pinned=pinned & set(names), queued=queued & set(names))


def eviction_order(policy: EvictionPolicy, view: TierView) -> list[str]:
    """Every evictable node, first victim first: the not-queued ones in the policy's order, then
    the queued ones in the policy's order."""
    names = view.evictable
    return policy.order(view, [n for n in names if n not in view.queued]) + policy.order(
        view, [n for n in names if n in view.queued])


def select_victims(policy: EvictionPolicy, view: TierView, need: int) -> tuple[str, ...] | None:
    """The leading nodes of `eviction_order` (those with a footprint) whose footprints first sum to
    at least `need` (the tier's unit); `()` when `need <= 0`; None when evicting every evictable node is not enough
    (the caller waits for a pinned node to be released)."""
    if need <= 0:
        return ()
    victims: list[str] = []
    freed = 0
    for name in eviction_order(policy, view):
        size = view.graph.footprint(name)
        if size == 0:
            continue  # frees nothing
        victims.append(name)
        freed += size
        if freed >= need:
            return tuple(victims)
    return None
