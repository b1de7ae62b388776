"""Request assigning across DP ranks (CoServe §4.2) and its "parallel" baseline. Pure functions
of per-rank state, registered by name (`ASSIGNERS`, `assigner`).

Each rank's queue (its requests assigned and not finished) takes, with the latency model of the
rank's device (`KindProfile` per adapter kind; ranks may differ, as CoServe's CPU and GPU
executors do):

    time(queue) = sum over adapters a with n_a queued requests:
                  K * n_a + B * ceil(n_a / max_batch) + switch(a)

(requests of one adapter are arranged together, §4.2 "request arranging", and split into
batches of at most `max_batch`, "request splitting"). The switch latency of adapter `a` is the
kind's `load_s`, or 0 when `a` is resident on the rank; the base model never switches. Adding
one request for `a` costs

    delta = K + (B if n_a % max_batch == 0 else 0) + (0 if a is resident or n_a > 0 else load_s)

(the first request of a batch costs K + B, later ones K; with requests of `a` already queued,
`a` is loaded while the preceding requests run, so the new one adds no switch).

**coserve** ("minimising the current total inference time across all executor queues"): pick the
rank that minimises the largest queue time after the assignment; ties go to the smallest
increase `delta` ("preserves more assignment capacity for future requests"), then to the rank
with less queued time, then to the lowest index.

**parallel** (adapter-unaware, today's router): the rank with the fewest queued requests, ties
to the lowest index. (CoServe's "Samba-CoE Parallel" deals requests round-robin; least-loaded
is what our coordinator's router does.)
"""

from __future__ import annotations

from collections.abc import Callable, Container, Mapping, Sequence
from dataclasses import dataclass, field

from elasticmoe.adapter_policy.profile import BASE_KIND, KindProfile

_EPS = 1e-12  # times closer than this are equal (ties)


@dataclass(frozen=True, slots=True)
class RouteRequest:
    """What the router knows of a request: its adapter (None: the base model) and that adapter's
    kind ("lora", "esft", ...; the base model's is "base")."""

    adapter: str | None
    kind: str = "lora"

    def __post_init__(self) -> None:
        if self.adapter is None and self.kind != BASE_KIND:
            object.__setattr__(self, "kind", BASE_KIND)


@dataclass(frozen=True, slots=True)
class RankState:
    """One DP rank as the router sees it.

    `queued`: unfinished requests assigned to the rank, per adapter (None: base). `kind_of`:
    the kind of each queued adapter ("lora" when absent). `kinds`: the latency model of the
    rank's device per kind; every kind that occurs must be there.
    """

    queued: Mapping[str | None, int]
    resident: Container[str]
    kinds: Mapping[str, KindProfile]
    kind_of: Mapping[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        bad = {a: n for a, n in self.queued.items() if n < 0}
        if bad:
            raise ValueError(f"rank state: negative queued counts {bad}")

    @property
    def num_queued(self) -> int:
        return sum(self.queued.values())

    def kind(self, adapter: str | None, default: str = "lora") -> KindProfile:
        """The latency model of `adapter`'s kind (`default` if `kind_of` does not say)."""
        name = BASE_KIND if adapter is None else self.kind_of.get(adapter, default)
        if name not in self.kinds:
            raise ValueError(f"rank state: no latency model for kind {name!r} (of adapter {adapter!r})")
        return self.kinds[name]

    def switch_s(self, adapter: str | None, kind: KindProfile) -> float:
        """The switch latency a first request for `adapter` pays on this rank."""
        return 0.0 if adapter is None or adapter in self.resident else kind.load_s


def queue_time(rank: RankState) -> float:
    """Seconds to run the rank's whole queue (see the module docstring)."""
    total = 0.0
    for adapter, n in rank.queued.items():
        if n <= 0:
            continue
        kind = rank.kind(adapter)
        batches = -(-n // kind.max_batch)
        total += kind.k_s * n + kind.b_s * batches + rank.switch_s(adapter, kind)
    return total


def added_time(rank: RankState, request: RouteRequest) -> float:
    """Seconds one more request for `request.adapter` adds to the rank's queue."""
    n = rank.queued.get(request.adapter, 0)
    kind = rank.kind(request.adapter, default=request.kind)
    delta = kind.k_s + (kind.b_s if n % kind.max_batch == 0 else 0.0)
    return delta + (rank.switch_s(request.adapter, kind) if n == 0 else 0.0)


def choose_rank(ranks: Sequence[RankState], request: RouteRequest) -> int:
    """CoServe's assignment: the index of the rank that keeps the longest queue shortest; ties
    to the smallest increase, then the shorter queue, then the lowest index."""
    if not ranks:
        raise ValueError("choose_rank: no ranks")
    times = [queue_time(r) for r in ranks]
    deltas = [added_time(r, request) for r in ranks]
    best, best_key = 0, (0.0, 0.0, 0.0)
    for i in range(len(ranks)):
        others = max((t for j, t in enumerate(times) if j != i), default=0.0)
        key = (max(times[i] + deltas[i], others), deltas[i], times[i])
        if i == 0 or _less(key, best_key):
            best, best_key = i, key
    return best


def choose_rank_least_loaded(ranks: Sequence[RankState], request: RouteRequest) -> int:
    """The "parallel" baseline: fewest queued requests, ties to the lowest index (adapter-unaware)."""
    if not ranks:
        raise ValueError("choose_rank: no ranks")
    return min(range(len(ranks)), key=lambda i: ranks[i].num_queued)


def _less(a: tuple[float, ...], b: tuple[float, ...]) -> bool:
    """Lexicographic `a < b` where entries within `_EPS` count as equal."""
    for x, y in zip(a, b, strict=True):
        if x < y - _EPS:
            return True
        if x > y + _EPS:
            return False
    return False


ASSIGNERS: dict[str, Callable[[Sequence[RankState], RouteRequest], int]] = {
    "coserve": choose_rank,
    "parallel": choose_rank_least_loaded,
}


def assigner(name: str) -> Callable[[Sequence[RankState], RouteRequest], int]:
    """The registered assigning function `name`; `ValueError` naming `request_assigning` otherwise."""
    if name not in ASSIGNERS:
        raise ValueError(f"request_assigning: expected one of {sorted(ASSIGNERS)}, got {name!r}")
    return ASSIGNERS[name]
