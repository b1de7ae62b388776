"""Request routing in the ingress: a DP rank of the published instance, held while the coordinator
says so.

The router holds the latest `RoutingState` the coordinator published (`update`, from the
ingress's follower) and knows its ranks only as opaque targets with their requests in flight
per adapter, so it can be tested without Ray. Which rank: `assign` names the policy of
`elasticmoe.adapter_policy.assigning`: `coserve` (CoServe §4.2: the rank whose queue, with the
latency model K*n + B per adapter and the switch latency of a non-resident adapter, keeps the
longest queue shortest) or `parallel` (the least-loaded rank, adapter-unaware). The latency
model comes from the server's profile (`serve --profile`), else a unit cost per request. With
`prefix_affinity` a request goes instead to the rank it most likely finds its prompt's prefix
cached on, unless that rank is busier (`coordinator.prefix_affinity`). New requests wait (for at most `max_hold_s`) while the state says
`is_accepting=False`: a switchover's critical section, a repair replacing a dead instance,
or a coordinator that cannot be reached; then they go to whatever ranks are published.
A request turned away by a rank that was pausing waits for the next state (`wait_newer`),
one whose rank failed until that rank is no longer published (`wait_replaced`).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import time
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from coordinator.lora_residency import RecentLora
from coordinator.prefix_affinity import PrefixAffinity
from coordinator.routing_state import RoutingState
from elasticmoe.adapter_policy.assigning import RankState, RouteRequest, assigner
from elasticmoe.adapter_policy.profile import BASE_KIND, KindProfile

T = TypeVar("T")


class NoActiveInstance(RuntimeError):
    """No instance can take requests (none published, or requests were held too long)."""


# Without a profile every request costs the same: the assignment balances requests, adapter-aware.
UNIT_COST = KindProfile(max_batch=1 << 30, k_s=1.0, b_s=0.0)
# ... and, where the ranks hold different LoRA adapters (`lora_slots_per_rank`), a switch costs what
# one request does: a request goes to the rank holding its adapter while that rank's queue is at
# most one request longer than the shortest. (A q/v slot's copy is ~0.2 ms, but at a saturating
# rate a switch also waits for a slot no running request pins.)
UNIT_SWITCH = KindProfile(max_batch=1 << 30, k_s=1.0, b_s=0.0, load_s=1.0)


@dataclass
class _Routes(Generic[T]):
    targets: list[T]
    in_flight: list[collections.Counter[str | None]] = field(default_factory=list)  # per rank, per adapter

    def __post_init__(self) -> None:
        self.in_flight = [collections.Counter() for _ in self.targets]


@dataclass(frozen=True, slots=True)
class Route(Generic[T]):
    """A rank chosen for a request, and the state it was chosen from."""

    rank: T
    key: tuple[str, int]  # `RoutingState.key`


class Router(Generic[T]):
    """Least-loaded choice among the published ranks, by requests in flight.

    Invariant: `in_flight` counts requests between `route()` entering and its context exiting,
    per rank of the state they were routed by; requests of a replaced instance finish against
    its own counters. Lives on one event loop (the ingress's): `update` is called there.
    """

    def __init__(self, max_hold_s: float = 30.0, assign: str = "coserve",
                 kinds: Mapping[str, KindProfile] | None = None, prefix_affinity: bool = False,
                 lora_slots_per_rank: int = 0) -> None:
        """`lora_slots_per_rank` > 0: each rank swaps its own LoRA slots (of attention modules only),
        that many, so the ranks hold different adapters (`coordinator.lora_residency`); 0: every
        rank holds the same ones (one rank, or slots on the experts, swapped in lockstep)."""
        self.max_hold_s = max_hold_s
        self.prefix_affinity = prefix_affinity
        self._affinity: PrefixAffinity | None = None  # of the published ranks (their caches start empty)
        self.lora_slots_per_rank = lora_slots_per_rank
        self._recent_lora: RecentLora | None = None  # of the published ranks (a new instance's slots differ)
        self.choose = assigner(assign)
        # NOTE: every kind gets a model (the profile's, else the unit cost): the assigner needs one.
        self.kinds: dict[str, KindProfile] = {k: UNIT_COST for k in (BASE_KIND, "lora", "esft")}
        if lora_slots_per_rank:
            self.kinds["lora"] = UNIT_SWITCH
        self.kinds.update(kinds or {})
        self.state: RoutingState | None = None  # the last state published
        # Of the last state, for every request's assignment (a state lists every registered adapter)
        self._kind_of: dict[str, str] = {}
        self._resident: frozenset[str] = frozenset()
        self._routes: _Routes[T] | None = None
        self._changed = asyncio.Event()  # set (and replaced) whenever the state changes
        self.num_held = 0  # requests currently held (for metrics)
        self.assign_s = 0.0  # time spent choosing ranks (--request-assigning; CoServe Fig. 15)

    def update(self, state: RoutingState) -> None:
        """Take a newly published state; in-flight counts are kept while its ranks are the same."""
        if self.state is None or self._routes is None or state.ranks != self.state.ranks:
            self._routes = _Routes(list(state.ranks))
            # A new instance's engines start with empty prefix caches (a handover drops the names).
            self._affinity = PrefixAffinity(len(state.ranks)) if self.prefix_affinity else None
            self._recent_lora = (RecentLora(len(state.ranks), self.lora_slots_per_rank)
                                 if self.lora_slots_per_rank and len(state.ranks) > 1 else None)
        if self.state is None or state.adapters != self.state.adapters or state.swapped_out != self.state.swapped_out:
            self._resident = frozenset(state.adapters) - frozenset(state.swapped_out)
        if self.state is None or state.adapter_kinds != self.state.adapter_kinds:
            self._kind_of = dict(state.adapter_kinds)
        self.state = state
        changed, self._changed = self._changed, asyncio.Event()
        changed.set()

    @property
    def is_accepting(self) -> bool:
        state = self.state
        return state is not None and state.is_accepting

    def is_active_target(self, target: T) -> bool:
        routes = self._routes
        return routes is not None and any(t is target or t == target for t in routes.targets)

    async def _wait_until(self, done: Callable[[], bool], timeout_s: float) -> bool:
        deadline = asyncio.get_running_loop().time() + timeout_s
        while not done():
            remaining = deadline - asyncio.get_running_loop().time()
            if remaining <= 0:
                return False
            try:
                await asyncio.wait_for(self._changed.wait(), remaining)
            except TimeoutError:
                return False
        return True

    async def wait_replaced(self, target: T, timeout_s: float) -> bool:
        """Wait until `target` is no longer published (its instance was replaced); False if it
        still is after `timeout_s`."""
        return await self._wait_until(lambda: not self.is_active_target(target), timeout_s)

    async def wait_newer(self, key: tuple[str, int], timeout_s: float) -> bool:
        """Wait until a state other than the one keyed `key` is published; False after `timeout_s`."""
        return await self._wait_until(lambda: self.state is not None and self.state.key != key, timeout_s)

    async def wait_resident(self, adapter: str, timeout_s: float) -> bool:
        """Wait until a published state no longer lists `adapter` as swapped out; False after
        `timeout_s`."""
        return await self._wait_until(lambda: self.state is not None and adapter not in self.state.swapped_out,
                                      timeout_s)

    def loads(self) -> list[int]:
        return [sum(c.values()) for c in self._routes.in_flight] if self._routes else []

    def _choose(self, routes: _Routes[T], adapter: str | None, kind: str) -> int:
        kind_of, resident, recent = self._kind_of, self._resident, self._recent_lora
        if recent is None:  # the ranks hold the same adapters
            ranks = [RankState(counts, resident, self.kinds, kind_of) for counts in routes.in_flight]
            return self.choose(ranks, RouteRequest(adapter, kind))
        ranks = [RankState(counts, recent.view(i, resident, kind_of), self.kinds, kind_of)
                 for i, counts in enumerate(routes.in_flight)]
        return self.choose(ranks, RouteRequest(adapter, kind))

    @contextlib.asynccontextmanager
    async def route(self, adapter: str | None = None, prompt: Sequence[int] = (),
                    cache_salt: str | None = None) -> AsyncIterator[Route[T]]:
        """Yield the rank the assignment picks for a request of `adapter` (None: the base model)
        and `prompt` (token ids; empty: no prefix affinity) with its `cache_salt`; its in-flight
        count covers the body of the `async with`."""
        if not self.is_accepting:
            self.num_held += 1
            try:
                if not await self._wait_until(lambda: self.is_accepting, self.max_hold_s):
                    raise NoActiveInstance(f"requests were held for {self.max_hold_s:.0f}s (no instance accepting)")
            finally:
                self.num_held -= 1
        routes, state = self._routes, self.state
        if routes is None or state is None or not routes.targets:
            raise NoActiveInstance("no active instance")
        start = time.perf_counter()
        kind = self._kind_of.get(adapter, "lora") if adapter else BASE_KIND
        rank = self._choose(routes, adapter, kind)
        affinity = self._affinity
        if affinity is not None and prompt:
            names = affinity.names(prompt, adapter, cache_salt)
            rank = affinity.choose(names, self.loads(), rank)
            affinity.record(rank, names)
        if self._recent_lora is not None and adapter is not None and kind == "lora":
            self._recent_lora.record(rank, adapter)  # the rank swaps it in for this request
        self.assign_s += time.perf_counter() - start
        counts = routes.in_flight[rank]
        counts[adapter] += 1
        try:
            yield Route(routes.targets[rank], state.key)
        finally:
            counts[adapter] -= 1
            if not counts[adapter]:
                del counts[adapter]
