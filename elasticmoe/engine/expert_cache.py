"""The engine's expert cache: a byte budget of expert rows shared by every MoE layer.

The cache is one pool of `capacity` rows, `w13` [C, 2I, H] and `w2` [C, H, I], that every MoE
layer's grouped GEMM reads (each layer's expert tensor is a view of the same pool: a row freed in
one layer holds another layer's expert next, the global budget of FineMoE's constraint (3)). A
map `slot_of[l, e]` (pool row of expert e of layer l, -1 = not resident) is what the MoE block
consults; `CacheState` (`elasticmoe.offload`) is the policy-facing view of the same residency.

Two threads load rows: the forward thread (`ensure`: the experts a layer needs now, "on-demand")
and the prefetch thread (`prefetch_once`: the policy's plan, ahead of the forward). One lock
guards the map, the state and the policy; the copies run outside it. The rules that keep them
apart:
- at most one prefetch copy is in flight; an `ensure` that must load pauses prefetching
  (FineMoE §4.5: the forward needs the memory bandwidth now) and runs its copies beside the one
  in flight, which it may not evict (its row is being written); it waits for that copy only
  when it needs that expert, or that row. (The paper's GPU pauses at the PCIe link; here the
  two copies run on two cores, and waiting would add the rest of the prefetch to the forward's
  time: on-demand loads took 200-320 us each with the wait against ~150 for one copy.)
- a row is published in `slot_of` only once its copy is complete, and an expert the forward
  thread is computing with, or that the current layer's router just chose (`protected`), is
  never a prefetch's victim;
- a failed copy leaves the expert not resident and its row free, so a read error costs the
  request that needed it, never the cache's consistency.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from elasticmoe.engine.expert_sources import ExpertSource
from elasticmoe.offload.cache_ops import CacheTooSmallError, CacheUpdate, load_on_demand, next_prefetch
from elasticmoe.offload.cache_state import CacheState, ExpertKey
from elasticmoe.offload.policy import OffloadPolicy, PrefetchPlan

logger = logging.getLogger(__name__)


@dataclass
class CacheCounters:
    """What the cache did since it was created (exported as metrics)."""

    lookups: int = 0  # (iteration, layer, expert) lookups by the forward
    hits: int = 0  # ... whose expert was resident or being prefetched
    on_demand_loads: int = 0
    prefetches: int = 0  # prefetch copies completed
    prefetches_useful: int = 0  # ... of experts the forward used before they left
    prefetches_wasted: int = 0  # ... evicted unused
    prefetch_failures: int = 0
    evictions: int = 0
    waits_for_prefetch: int = 0  # lookups that found their expert's prefetch still copying
    warm_loads: int = 0  # rows filled before serving, most used first (`ExpertCache.warm`)
    on_demand_s: float = 0.0  # the forward's time in `ensure` beyond its hits: waiting and copying
    prefetch_s: float = 0.0  # the prefetch thread's copying time (beside the forward)

    @property
    def hit_rate(self) -> float:
        return self.hits / self.lookups if self.lookups else 0.0


class ExpertCache:
    """Pool rows, residency map and the policy that decides what enters and leaves them."""

    def __init__(self, policy: OffloadPolicy, source: ExpertSource, pool_w13: torch.Tensor, pool_w2: torch.Tensor,
                 local_expert_ids: Sequence[int], num_layers: int, num_experts: int) -> None:
        self.policy = policy
        self.source = source
        self.w13, self.w2 = pool_w13, pool_w2
        self.capacity = int(pool_w13.shape[0])
        self.expert_bytes = pool_w13[0].nbytes + pool_w2[0].nbytes
        self.local_of = {int(e): i for i, e in enumerate(local_expert_ids)}  # global expert -> local index
        self.state = CacheState.empty(num_layers, num_experts, self.capacity)
        self.slot_of = np.full((num_layers, num_experts), -1, dtype=np.int64)
        self.counters = CacheCounters()
        self.bytes_loaded = {source.tier: 0}
        self._free = list(range(self.capacity - 1, -1, -1))  # pop() hands out row 0 first
        self._cond = threading.Condition()
        self._paused = 0
        self._in_flight: ExpertKey | None = None
        self._plan: PrefetchPlan | None = None
        self._protected: frozenset[ExpertKey] = frozenset()
        self._unused_prefetches: set[ExpertKey] = set()
        self._closed = False

    @property
    def holds_every_expert(self) -> bool:
        """The budget has a row for every expert of this rank: nothing is ever evicted."""
        return self.capacity >= self.slot_of.shape[0] * len(self.local_of)

    # ---- the forward thread ------------------------------------------------------------

    def ensure(self, layer: int, experts: Sequence[int]) -> list[int]:
        """Make `experts` (global ids, at most `capacity` of them) of MoE layer `layer` resident
        and return their pool rows, in order. Loads what is missing now, evicting the policy's
        victims; the experts stay protected from prefetch evictions until the next `ensure`."""
        keys = [(layer, int(e)) for e in experts]
        started = time.perf_counter()
        with self._cond:
            rows = self.slot_of[layer, experts]
            if (rows >= 0).all():
                # Every expert published: a copy in flight is into another row, so there is
                # nothing to wait for and no reason to pause prefetching (the common case).
                self._count_lookups(keys)
                self.state = self.state.use(layer, experts)
                self._protected = frozenset(keys)
                return rows.tolist()
            self._paused += 1
            try:
                while self._in_flight is not None and self._in_flight in keys:
                    self.counters.waits_for_prefetch += 1
                    self._cond.wait()
                self._count_lookups(keys)
                update = self._load_beside_prefetch(layer, experts)
                for key in update.evicted:
                    self._release(key)
                loads = [(key, self._free.pop()) for key in update.loaded]
                self.state = update.cache
                self._protected = frozenset(keys)
            except BaseException:
                self._resume()
                raise
        try:
            for key, row in loads:  # prefetching is paused: this thread alone copies
                self._copy(key, row)
        except BaseException:
            with self._cond:
                self.state = self.state.evict([key for key, _ in loads])
                self._free.extend(row for _, row in loads)
                self._resume()
            raise
        with self._cond:
            for key, row in loads:
                self.slot_of[key] = row
            self.counters.on_demand_loads += len(loads)
            self.counters.on_demand_s += time.perf_counter() - started
            self.state = self.state.use(layer, experts)
            # NOTE: the plan stays the one `observe` made for this layer: what became resident since
            # is skipped by `next_prefetch`, and asking the policy again per layer costs the forward.
            self._resume()
            return [int(self.slot_of[key]) for key in keys]

    def _load_beside_prefetch(self, layer: int, experts: Sequence[int]) -> CacheUpdate:
        """`load_on_demand` while a prefetch copy of another expert may be in flight: its row is
        being written, so it is no victim; only when the layer needs that row too (a cache
        barely larger than the layer's experts) does the forward wait for the copy. Holds the lock."""
        while True:
            in_flight = (self._in_flight,) if self._in_flight is not None else ()
            try:
                return load_on_demand(self.state, self.policy, layer, experts, protected=in_flight)
            except CacheTooSmallError:
                if not in_flight:
                    raise
            self._cond.wait()

    def warm(self, popularity: np.ndarray) -> int:
        """Fill free rows with this rank's most used experts by `popularity` [L, E] (the tokens an
        instance routed before a scale, all its ranks summed: `LLMEngine.expert_load`), before
        serving: a scale then leaves the least needed experts in the host tier, not whichever the
        first requests hit.
        A failed copy leaves its expert out (loaded on demand later). Returns the rows filled."""
        if popularity.shape != self.slot_of.shape:
            raise ValueError(f"warm: popularity is {popularity.shape}, the cache maps {self.slot_of.shape}")
        order = np.argsort(-popularity, axis=None, kind="stable")
        with self._cond:
            self._paused += 1
            keys: list[ExpertKey] = []
            for flat in order[: int((popularity > 0).sum())]:
                layer, expert = divmod(int(flat), popularity.shape[1])
                if len(keys) == self.state.num_free:
                    break
                if expert in self.local_of and not self.state.is_resident((layer, expert)):
                    keys.append((layer, expert))
            loads = [(key, self._free.pop()) for key in keys]
            self.state = self.state.load(keys)
        filled = 0
        try:
            for key, row in loads:
                try:
                    self._copy(key, row)
                except Exception:  # noqa: BLE001 - a warm start is an optimisation; on demand covers it
                    logger.exception("warming expert %s failed", key)
                    with self._cond:
                        self.state = self.state.evict([key])
                        self._free.append(row)
                    continue
                with self._cond:
                    self.slot_of[key] = row
                filled += 1
        finally:
            with self._cond:
                self.counters.warm_loads += filled
                self._resume()
        return filled

    def replan(self, routed: tuple[int, Sequence[int]] | None = None) -> None:
        """Take the policy's current plan (after it observed a layer or began an iteration).
        `routed` (layer, global expert ids): the experts that layer's router just chose, which its
        `ensure` asks for next; from now on they are no prefetch's victims. (Before, a copy for
        the next layer could evict one of them in the moment between the router and `ensure`:
        LRU ranks them oldest, having last used them an iteration ago.)"""
        with self._cond:
            if routed is not None:
                layer, experts = routed
                self._protected = frozenset((layer, e) for e in experts if e in self.local_of)
            self._plan = self._policy_plan()
            self._wake_prefetcher()

    def _wake_prefetcher(self) -> None:
        # Only when there is something to copy: a wake-up per layer for nothing costs a context
        # switch on every MoE layer of every step.
        if self._plan is not None and self._plan.items and not self._paused:
            self._cond.notify_all()

    def _policy_plan(self) -> PrefetchPlan | None:
        """The policy's plan; None (no prefetching until the next one) if it raises: a policy's
        fault costs hit rate, never a request."""
        try:
            return self.policy.prefetch_plan(self.state)
        except Exception:  # noqa: BLE001
            logger.exception("offload policy %s: prefetch_plan failed", self.policy.name)
            return None

    def locked(self) -> threading.Condition:
        """The lock to hold around any other call into the policy (policies are not thread-safe)."""
        return self._cond

    def _count_lookups(self, keys: list[ExpertKey]) -> None:
        self.counters.lookups += len(keys)
        for key in keys:
            if self.state.is_resident(key):
                self.counters.hits += 1
                if key in self._unused_prefetches:
                    self._unused_prefetches.discard(key)
                    self.counters.prefetches_useful += 1

    def _resume(self) -> None:
        self._paused -= 1
        self._wake_prefetcher()

    # ---- the prefetch thread -----------------------------------------------------------

    def prefetch_once(self) -> bool:
        """Wait for work, then copy the plan's next expert in. False once the cache is closed."""
        with self._cond:
            while True:
                if self._closed:
                    return False
                step = None
                if not self._paused and self._plan is not None:
                    plan = self._local_plan(self._plan)
                    step = next_prefetch(self.state, self.policy, plan, self._protected)
                    if step is None:
                        self._plan = None  # done, or nothing may be evicted for it
                if step is not None:
                    break
                self._cond.wait()
            if step.victim is not None:
                self._release(step.victim)
            key, row = step.item.key, self._free.pop()
            self.state = self.state.load([key])
            self._in_flight = key
        started = time.perf_counter()
        try:
            self._copy(key, row)
            ok = True
        except Exception:  # noqa: BLE001 - the forward loads it on demand (and reports) if it needs it
            logger.exception("prefetch of expert %s failed", key)
            ok = False
        with self._cond:
            self._in_flight = None
            self.counters.prefetch_s += time.perf_counter() - started
            if ok:
                self.slot_of[key] = row
                self.counters.prefetches += 1
                self._unused_prefetches.add(key)
            else:
                self.state = self.state.evict([key])
                self._free.append(row)
                self.counters.prefetch_failures += 1
                self._plan = None
            self._cond.notify_all()
        return True

    def _local_plan(self, plan: PrefetchPlan) -> PrefetchPlan:
        """The plan's experts this rank holds (under EP the policy also sees other ranks' experts)."""
        if all(item.expert in self.local_of for item in plan.items):
            return plan
        return PrefetchPlan(plan.after_layer, tuple(i for i in plan.items if i.expert in self.local_of))

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    # ---- both ----------------------------------------------------------------------------

    def _copy(self, key: ExpertKey, row: int) -> None:
        layer, expert = key
        nbytes = self.source.copy_into(layer, self.local_of[expert], self.w13[row], self.w2[row])
        self.bytes_loaded[self.source.tier] += nbytes

    def _release(self, key: ExpertKey) -> None:
        """Evict `key` (resident, published) from the state and the map; its row becomes free."""
        row = int(self.slot_of[key])
        self.slot_of[key] = -1
        self.state = self.state.evict([key])
        self._free.append(row)
        self.counters.evictions += 1
        if key in self._unused_prefetches:
            self._unused_prefetches.discard(key)
            self.counters.prefetches_wasted += 1

    def stats(self) -> dict[str, float | int | str]:
        with self._cond:
            c = self.counters
            return {
                "policy": self.policy.name, "capacity_experts": self.capacity, "expert_bytes": self.expert_bytes,
                "cache_bytes": self.capacity * self.expert_bytes, "resident_experts": self.state.num_resident,
                "lookups": c.lookups, "hits": c.hits, "hit_rate": round(c.hit_rate, 4),
                "on_demand_loads": c.on_demand_loads, "prefetches": c.prefetches,
                "prefetches_useful": c.prefetches_useful, "prefetches_wasted": c.prefetches_wasted,
                "prefetch_failures": c.prefetch_failures, "evictions": c.evictions,
                "waits_for_prefetch": c.waits_for_prefetch, "warm_loads": c.warm_loads, "on_demand_s": round(c.on_demand_s, 6),
                "prefetch_s": round(c.prefetch_s, 6),
                **{f"bytes_loaded_{tier}": n for tier, n in self.bytes_loaded.items()},
            }

    def check_integrity(self) -> None:
        """The map and the state agree and no row is used twice (tests and debug runs)."""
        with self._cond:
            self.state.check_integrity()
            rows = self.slot_of[self.slot_of >= 0]
            if len(set(rows.tolist())) != rows.size:
                raise AssertionError("expert cache: a pool row holds two experts")
            published = self.slot_of >= 0
            pending = {self._in_flight} if self._in_flight is not None else set()
            mismatched = np.argwhere(published != self.state.resident)
            if any((int(layer), int(e)) not in pending for layer, e in mismatched):
                raise AssertionError("expert cache: map and state disagree")
            if rows.size + len(self._free) + len(pending) != self.capacity:
                raise AssertionError("expert cache: rows lost")
