"""ESFT adapters beyond their slots on the elastic server: a registry on disk, a hot set in the slots.

An ESFT adapter registered while every slot (`--max-esft-adapters`) is taken stays on disk
(its directory; `slot` None). A request for it does not fail: the ingress asks the
coordinator to `make_resident` it and sends the request once it is (`swapped_out` in the
routing state names the adapters a request must wait for). One swap at a time, each a few
steps under the adapter lock, never holding it while requests drain:

1. the adapter is resident: done;
2. a scale runs: wait, so a swap never meets a half-built instance (an eviction already
   under way is finished first: the scale waits for that, `ClusterAdapterHost.wait_swaps`);
3. a slot is free: the HMM maps and fills the adapter's rows there and every rank of the
   active instance points its expert map at them (the same load as a registration);
4. else a victim is chosen by the configured eviction policy (`--adapter-eviction`, CoServe
   §4.3: usage probability ascending, from the profile or the declaration, else the observed
   rate; or `lru`, `fifo`) among the resident ones that are not fresh, those with live
   requests last. Fresh: swapped in within `min_resident_s`, or swapped in for waiting
   requests none of which reached a rank yet, unless every ingress that asked for it said its
   waiters are gone (`unwanted`: clients that left during the swap), and at most `reach_wait_s`
   (an ingress that could not say so). A timer alone would not do: on a host slower than it
   from swap to rank, two adapters through one slot would each be evicted before its requests
   arrive, for ever. Every rank stops admitting the victim at once (its later requests come
   back to wait, like any other swapped-out adapter's), and once no rank has a live request of
   it (under EP another rank's tokens may use its rows) every rank releases it and the HMM
   unmaps its rows: its slot is free for step 3.

A request that still reached a rank for an adapter swapped out meanwhile is refused there
before anything was streamed (`UnknownAdapterError`), and the ingress waits and sends it
again. Scales exclude swaps both ways: a scale waits for the eviction in progress to finish,
and no swap starts while a scale runs.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from typing import TYPE_CHECKING

import ray
from ray.exceptions import ActorUnavailableError, GetTimeoutError, RayActorError

from elasticmoe.adapter_policy.eviction import TierView, eviction_order, eviction_policy, slot_tier_view
from elasticmoe.adapter_policy.profile import load_profile
from elasticmoe.errors import UnknownAdapterError

if TYPE_CHECKING:
    from coordinator.adapters import AdapterState, ClusterAdapterHost

logger = logging.getLogger(__name__)

# How long a swapped-in adapter is not a victim at least: the rest of its waiting requests' way to
# a rank once the first arrived (they are sent together), after which its running requests keep
# it. A longer timer made the next swap wait it out, the adapter it evicts having just come in for
# another request: the tiny CoServe bench (3 ESFT adapters through 1 slot, 3 req/s) measured hot
# TTFT p99 1.9 s at dp 2 with 2 s, 0.50 s with 0.5 s, 0.12-0.13 s with 0.1 s (resident: 0.07 s),
# the same 7 swaps, no request failed. A request that still meets its adapter swapped out waits again.
MIN_RESIDENT_S = 0.1
# How long one swapped in for waiting requests stays until the first of them reached a rank: their
# arrival ends it; this bounds the slot's stall when they all gave up (clients gone).
REACH_WAIT_S = 10.0
REACH_POLL_S = 0.05  # how often the ranks are asked whether such an adapter's requests arrived
RANK_ANSWER_S = 10.0  # a rank's answer to those questions (a step or two of its loop)


class EsftResidency:
    """Which ESFT adapters hold the slots, and the swaps that change it (see the module docstring)."""

    def __init__(self, host: ClusterAdapterHost, eviction: str = "coserve", profile: str | None = None,
                 min_resident_s: float = MIN_RESIDENT_S, reach_wait_s: float = REACH_WAIT_S,
                 poll_s: float = 0.02) -> None:
        self.host = host
        self.policy = eviction_policy(eviction)
        self.profiled = load_profile(profile).usage_probability if profile else {}
        self.min_resident_s = min_resident_s
        self.reach_wait_s = reach_wait_s
        self.poll_s = poll_s
        self._swaps: asyncio.Lock | None = None  # one swap at a time (created on the coordinator's loop)
        self._seq = itertools.count(1)
        self.loaded_seq: dict[str, int] = {}  # FIFO's order
        self.used_seq: dict[str, int] = {}  # LRU's order (requests the ingress saw)
        self.num_requested: dict[str, int] = {}  # the observed rate (the fallback usage source)
        self.resident_at: dict[str, float] = {}
        self.awaited: set[str] = set()  # swapped in for waiting requests, none of which reached a rank yet
        self.askers: dict[str, int] = {}  # calls of `make_resident` per adapter no `unwanted` answered yet
        self.num_unwanted = 0  # swapped-in adapters given up early because their waiters were all gone
        self.num_swaps_in = 0
        self.num_evictions = 0
        self.swap_s = 0.0  # time from a swap's start to its adapter resident (waits for running requests too)

    def note_used(self, names: dict[str, int]) -> None:
        """The ingress saw requests for these adapters (name -> how many) since its last report."""
        for name, count in names.items():
            self.used_seq[name] = next(self._seq)
            self.num_requested[name] = self.num_requested.get(name, 0) + count

    def on_resident(self, name: str, awaited: bool = False) -> None:
        """`name` took a slot: at its registration, or (`awaited`) swapped in for waiting requests."""
        self.loaded_seq[name] = self.used_seq[name] = next(self._seq)
        self.resident_at[name] = time.monotonic()
        if awaited:
            self.awaited.add(name)

    def forget(self, name: str) -> None:
        for table in (self.loaded_seq, self.used_seq, self.num_requested, self.resident_at, self.askers):
            table.pop(name, None)
        self.awaited.discard(name)

    async def make_resident(self, name: str) -> None:
        """Return once `name` (a registered ESFT adapter) is resident and admitted by every rank
        of the active instance; `UnknownAdapterError` if it is not registered (or is unloading).
        The caller (an ingress) either sends the requests it waited for or says `unwanted`."""
        self.askers[name] = self.askers.get(name, 0) + 1
        # NOTE: shielded: a waiter that gives up (its client left) must not leave a victim half evicted.
        await asyncio.shield(self._swap(name))

    def unwanted(self, name: str) -> None:
        """An ingress whose `make_resident(name)` returned has no request left to send (its
        waiters' clients left during the swap). Once every asker said so, an adapter swapped in
        for them is no longer held for their arrival: the slot is not stalled for `reach_wait_s`."""
        left = self.askers.get(name, 0) - 1
        if left > 0:
            self.askers[name] = left
            return
        self.askers.pop(name, None)
        if name in self.awaited:
            self.awaited.discard(name)
            self.num_unwanted += 1
            logger.info("adapter %r: its waiters are gone; no longer held for them", name)

    async def _swap(self, name: str) -> None:
        if self._swaps is None:
            self._swaps = asyncio.Lock()
        async with self._swaps:
            start = time.monotonic()
            try:
                while (wait_s := await asyncio.to_thread(self._step, name)) is not None:
                    await asyncio.sleep(wait_s)
            finally:
                self.swap_s += time.monotonic() - start

    # ---- one step, under the adapter lock ---------------------------------------------------

    def _step(self, name: str) -> float | None:
        """Advance the swap for `name`: None when it is resident, else seconds to wait before the
        next step."""
        host = self.host
        if not host.lock.acquire(timeout=self.poll_s):
            return self.poll_s  # a registration or a scale's start holds it
        try:
            entry = host.adapters.get(name)
            if entry is None or entry.kind != "esft" or entry.state != "loaded":
                raise UnknownAdapterError(name)
            victim = next((a for a in host.adapters.values() if a.evicting), None)
            if entry.slot is not None and victim is not entry:
                return None
            if victim is not None:  # finish the eviction this swap started (a scale waits for it)
                if self._in_use(victim.name):
                    return self.poll_s
                self._release(victim)
            if host.cluster.scale_events.running is not None:
                return self.poll_s
            slot = host.free_esft_slot()
            if slot is not None:
                host.load_into(entry, slot)
                host.publish_registry()  # the ingress sends its waiting requests now
                self.on_resident(name, awaited=True)
                self.num_swaps_in += 1
                logger.info("adapter %r: swapped in to slot %d", name, slot)
                return None
            return self._start_eviction(exclude=name)
        finally:
            host.lock.release()

    def _start_eviction(self, exclude: str) -> float:
        """Choose a victim and stop admitting it everywhere; the seconds until the next step."""
        host = self.host
        resident = [a for a in host.adapters.values()
                    if a.kind == "esft" and a.slot is not None and a.state == "loaded" and a.name != exclude]
        now = time.monotonic()
        fresh = {a.name for a in resident if self._is_fresh(a.name, now - self.resident_at.get(a.name, 0.0))}
        order = eviction_order(self.policy, self._view(resident, fresh))
        if not order:  # every slot was filled moments ago: wait until one is not fresh
            ages = [now - self.resident_at.get(a.name, 0.0) for a in resident]
            timers = [self.min_resident_s - age for age in ages if age < self.min_resident_s]
            # NOTE: one that only waits for its requests may be reached at any moment: ask again soon.
            return max(self.poll_s, min(timers) if len(timers) == len(ages) else REACH_POLL_S)
        victim = host.adapters[order[0]]
        victim.evicting = True
        host.stop_admitting(victim.name)
        self.num_evictions += 1
        logger.info("adapter %r: swapping out of slot %s for %r (%s)", victim.name, victim.slot, exclude,
                    self.policy.name)
        return 0.0

    def _view(self, resident: list[AdapterState], fresh: set[str]) -> TierView:
        names = [a.name for a in resident]
        declared = {a.name: a.usage_probability for a in resident if a.usage_probability is not None}
        return slot_tier_view(names, self.loaded_seq, self.used_seq, self.num_requested, self.profiled, declared,
                              pinned=frozenset(fresh),
                              queued=frozenset(n for n in names if n not in fresh and self._in_use(n)))  # running: last

    def _is_fresh(self, name: str, age_s: float) -> bool:
        """Not a victim yet: swapped in moments ago, or no request of it reached a rank since."""
        if age_s < self.min_resident_s:
            return True
        if name not in self.awaited:
            return False
        if age_s >= self.reach_wait_s or self._admitted(name):
            self.awaited.discard(name)
            self.askers.pop(name, None)  # their requests arrived (or will not): no answer is waited for
            return False
        return True

    def _admitted(self, name: str) -> bool:
        """Some rank of the active instance admitted a request of `name` since it loaded it (not
        known, e.g. a rank being replaced: no, and the adapter stays until `reach_wait_s`)."""
        counts = self._ask_ranks("adapter_admitted", name)
        return counts is not None and sum(counts) > 0

    def _in_use(self, name: str) -> bool:
        """Some rank of the active instance has a live request of `name` (not known, e.g. a rank
        being replaced: yes, ask again later)."""
        answers = self._ask_ranks("adapter_in_use", name)
        return answers is None or any(answers)

    def _ask_ranks(self, method: str, name: str) -> list | None:
        """Every rank's answer to `method(name)`; None if there is no active instance or a rank
        cannot answer within `RANK_ANSWER_S` (dead, or hung: the healer deals with it, and this
        poll, which holds the adapter lock, must not wait for that)."""
        inst = self.host.cluster.active
        if inst is None:
            return None
        try:
            return ray.get([getattr(rank, method).remote(name) for rank in inst.ranks], timeout=RANK_ANSWER_S)
        except (RayActorError, ActorUnavailableError, GetTimeoutError):
            return None

    def _release(self, victim: AdapterState) -> None:
        inst = self.host.cluster.active
        assert inst is not None
        self.host.release_everywhere(victim.name, inst)
        victim.slot, victim.evicting = None, False  # swapped out since `stop_admitting` published it so
        self.resident_at.pop(victim.name, None)
        self.awaited.discard(victim.name)
        self.askers.pop(victim.name, None)
        logger.info("adapter %r: swapped out", victim.name)
