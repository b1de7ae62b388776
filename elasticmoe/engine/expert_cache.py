"""The engine's expert cache: a byte budget of expert rows shared by every MoE layer.

The cache is one pool of `capacity` rows, `w13` [C, 2I, H] and `w2` [C, H, I], that every MoE
layer's grouped GEMM reads (each layer's expert tensor is a view of the same pool: a row freed in
one layer holds another layer's expert next, the global budget of FineMoE's constraint (3)). A
map `slot_of[l, e]` (pool row of expert e of layer l, -1 = not resident) is what the MoE block
consults; `CacheState` (`elasticmoe.offload`) is the policy-facing view of the same residency.

Every decision is made on the forward thread; the copies are made on two:
- `ensure` (on demand): the experts a layer needs now, copied by the forward thread itself (and,
  where the copier polls on a core of its own, half of them by the copier: `_copy_all`);
- `replan` (at an iteration's start, and after each layer's experts were ensured): the policy's
  plan becomes a queue of copies, each with its row and its victim, submitted to a copier
  (`expert_copier`) that copies beside the forward without taking the GIL. A new plan cancels the
  copies not started and queues its own.
The rules that keep the two apart:
- a queued copy's victim leaves `slot_of` at once (its row will be written), but a copy cancelled
  before it started gives the victim its row back: the row was never written (`CacheState.
  reinstate`). A lookup that needs a queued copy's victim, or a queued expert, cancels the queue
  and finds the victim resident (a hit), or loads the expert itself;
- an `ensure` that must load pauses the copier (FineMoE §4.5: the forward needs the memory
  bandwidth now) and runs its copies beside the one in progress, which it may not evict (its row is
  being written); it waits for that copy only when it needs that expert, or that row (a cache
  barely larger than the layer's experts). Then the plan is queued again;
- a copy is published in `slot_of` only once it has finished (`_publish_finished`, at the next
  lookup or plan), and an expert the forward thread is computing with (`protected`: the last
  `ensure`'s) is never a prefetch's victim;
- a failed copy leaves the expert not resident and its row free, so a read error costs the
  request that needed it, never the cache's consistency;
- a hit's visit reaches the snapshot when its usage is next read (`state`: a victim choice, a load,
  the stats) or after one iteration's worth of layers, all pending hits in one transition
  (`CacheState.use_many`, the snapshot of applying them in turn); every other transition starts
  from `state`, so only the hit path and a plan (which reads residency only) see `_state` as is.
One lock guards the map, the state and the policy (other threads read the stats).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from elasticmoe.engine.expert_copier import ExpertCopier, ThreadCopier, make_copier
from elasticmoe.engine.expert_sources import ExpertSource
from elasticmoe.kernels.copy_engine import FIRST_HALF
from elasticmoe.offload.cache_ops import CacheTooSmallError, CacheUpdate, load_on_demand, run_prefetch
from elasticmoe.offload.cache_state import CacheState, ExpertKey
from elasticmoe.offload.policy import OffloadPolicy, PrefetchPlan

logger = logging.getLogger(__name__)


@dataclass
class CacheCounters:
    """What the cache did since it was created (exported as metrics)."""

    lookups: int = 0  # (iteration, layer, expert) lookups by the forward
    hits: int = 0  # ... whose expert was resident, or being prefetched (the lookup waited for it)
    on_demand_loads: int = 0
    prefetches: int = 0  # prefetch copies completed
    prefetches_useful: int = 0  # ... of experts the forward used before they left
    prefetches_wasted: int = 0  # ... evicted unused
    prefetches_cancelled: int = 0  # queued copies dropped before they started (a newer plan, a load)
    prefetch_failures: int = 0
    evictions: int = 0
    waits_for_prefetch: int = 0  # lookups that found their expert's prefetch still copying
    warm_loads: int = 0  # rows filled before serving, most used first (`ExpertCache.warm`)
    on_demand_s: float = 0.0  # the forward's time in `ensure` beyond its hits: waiting and copying

    @property
    def hit_rate(self) -> float:
        return self.hits / self.lookups if self.lookups else 0.0


@dataclass(frozen=True, slots=True)
class QueuedCopy:
    """A prefetch submitted to the copier and not yet published: `key` into `row`, which held
    `victim` (None: a free row)."""

    copy_id: int
    key: ExpertKey
    row: int
    victim: ExpertKey | None


class ExpertCache:
    """Pool rows, residency map and the policy that decides what enters and leaves them."""

    def __init__(self, policy: OffloadPolicy, source: ExpertSource, pool_w13: torch.Tensor, pool_w2: torch.Tensor,
                 local_expert_ids: Sequence[int], num_layers: int, num_experts: int,
                 copier: ExpertCopier | None = None, copier_poll_us: int = 0) -> None:
        """`copier`: who makes the prefetch copies (default: `make_copier`, native where it can,
        its thread polling `copier_poll_us` before it sleeps)."""
        self.policy = policy
        self.source = source
        self.w13, self.w2 = pool_w13, pool_w2
        self.capacity = int(pool_w13.shape[0])
        self.expert_bytes = pool_w13[0].nbytes + pool_w2[0].nbytes
        self.local_of = {int(e): i for i, e in enumerate(local_expert_ids)}  # global expert -> local index
        self._state = CacheState.empty(num_layers, num_experts, self.capacity)
        # Hits not yet applied to `_state` (layer, experts): a step's lookups are applied together when
        # something next reads the usage (`state`), mostly once per step instead of once per MoE layer
        self._hits: list[tuple[int, Sequence[int]]] = []
        self.slot_of = np.full((num_layers, num_experts), -1, dtype=np.int64)
        self.counters = CacheCounters()
        self.bytes_loaded = {source.tier: 0}
        if copier is None:
            # A cache that holds every expert never evicts, so it plans nothing: no copy thread.
            copier = (ThreadCopier(source, pool_w13, pool_w2, start=False) if self.holds_every_expert
                      else make_copier(source, pool_w13, pool_w2, num_layers, len(self.local_of), copier_poll_us))
        self.copier = copier
        # A copier that polls has a core of its own: an on-demand load gives it half of the
        # layer's missing experts and copies the other half itself (`_copy_all`).
        self._copier_shares_loads = copier.polls
        self._free = list(range(self.capacity - 1, -1, -1))  # pop() hands out row 0 first
        self._lock = threading.Lock()
        self._queued: deque[QueuedCopy] = deque()  # in copy id order
        self._plan: PrefetchPlan | None = None
        # The last `ensure`'s (layer, experts): the forward computes with them, no prefetch evicts them
        self._last_lookup: tuple[int, Sequence[int]] = (0, ())
        self._unused_prefetches: set[ExpertKey] = set()
        self._closed = False

    @property
    def state(self) -> CacheState:
        """The cache's snapshot, every lookup so far applied. Hold the lock (or be the forward thread
        between steps)."""
        self._apply_hits()
        return self._state

    @state.setter
    def state(self, state: CacheState) -> None:
        self._hits.clear()
        self._state = state

    def _apply_hits(self) -> None:
        if self._hits:
            self._state = self._state.use_many(self._hits)
            self._hits.clear()

    @property
    def holds_every_expert(self) -> bool:
        """The budget has a row for every expert of this rank: nothing is ever evicted."""
        return self.capacity >= self.slot_of.shape[0] * len(self.local_of)

    # ---- lookups (the forward thread) -------------------------------------------------------

    def ensure(self, layer: int, experts: Sequence[int]) -> list[int]:
        """Make `experts` (global ids, at most `capacity` of them) of MoE layer `layer` resident
        and return their pool rows, in order. Loads what is missing now, evicting the policy's
        victims; the experts stay protected from prefetch evictions until the next `ensure`."""
        started = time.perf_counter()
        with self._lock:
            self._publish_finished()
            # NOTE: Python lists, not NumPy indexing: this runs per MoE layer of every step on a
            # handful of experts, where each NumPy call's dispatch costs more than the lookup (and
            # the hit path makes no keys: each operation after the layer's GEMM starts cold).
            layer_rows = self.slot_of[layer].tolist()
            rows = [layer_rows[e] for e in experts]
            self._last_lookup = (layer, experts)
            if not rows or min(rows) >= 0:
                # Every expert published: the copies in progress are into other rows, so there is
                # nothing to wait for and no reason to stop them (the common case).
                self._count_hits(layer, experts)
                self._hits.append((layer, experts))
                if len(self._hits) >= len(self.slot_of):  # bounded: a cache without a policy reads no usage
                    self._apply_hits()
                return rows
            keys = [(layer, int(e)) for e in experts]
            self.copier.pause(True)
            try:
                # Queued copies give their victims back, and a queued expert this layer needs is
                # loaded here rather than after the queue's others; the plan is queued again below.
                self._cancel_queued()
                # Left: the copy in progress and copies finished since the last publish.
                for copy in [c for c in self._queued if c.key in keys]:
                    if copy.copy_id >= self.copier.finished():
                        self.counters.waits_for_prefetch += 1
                    self._wait_for(copy)
                self._count_lookups(layer, experts)
                self._load_now(layer, experts)
                self._state = self.state.use(layer, experts)
                self.counters.on_demand_s += time.perf_counter() - started
                return [int(self.slot_of[key]) for key in keys]
            finally:
                # NOTE: the plan is the one `replan` took for this layer: what became resident since is
                # skipped, and asking the policy again per layer costs the forward.
                self._queue_plan()
                self.copier.pause(False)

    def _load_now(self, layer: int, experts: Sequence[int]) -> None:
        """Copy the layer's missing experts on this thread, beside a prefetch copy in progress
        (paused copier, empty queue). Holds the lock."""
        update = self._load_beside_copy(layer, experts)
        for key in update.evicted:
            self._release(key)
        loads = [(key, self._free.pop()) for key in update.loaded]
        self._state = update.cache
        try:
            self._copy_all(loads)
        except BaseException:
            self._state = self.state.evict([key for key, _ in loads])
            self._free.extend(row for _, row in loads)
            raise
        for key, row in loads:
            self.slot_of[key] = row
        self.counters.on_demand_loads += len(loads)

    def _copy_all(self, loads: list[tuple[ExpertKey, int]]) -> None:
        """Copy `loads` (key, row) now: this thread, and the copier for half of them where it has
        a core of its own (two cores copy ~2x as fast as one here): the second half of the list,
        and of an odd count's middle expert the second half of its bytes, whose first half this
        thread copies (a single missing expert, FineMoE's usual miss, is then shared too). The
        copier is paused with an empty queue, or copying the prefetch that was in progress: it
        takes its share after that one. Returns once every row is written, also when this
        thread's copies raise (a row the copier still writes must not be handed out again)."""
        sharing = self._copier_shares_loads and not self._closed
        num_mine = len(loads) // 2 if sharing else len(loads)
        middle = loads[num_mine] if sharing and len(loads) % 2 else None
        theirs = loads[len(loads) - len(loads) // 2 :] if sharing else []
        submitted: list[tuple[int, ExpertKey]] = []  # the copier's copies: (id, expert)
        if theirs:
            first = self.copier.submit([(layer, self.local_of[e], row) for (layer, e), row in theirs])
            submitted += [(first + i, key) for i, (key, _) in enumerate(theirs)]
        if middle is not None:
            (layer, e), row = middle
            submitted.append((self.copier.submit_second_half((layer, self.local_of[e], row)), middle[0]))
        if submitted:
            self.copier.pause(False)
        middle_read = False
        try:
            for key, row in loads[:num_mine]:
                self._copy(key, row)
            if middle is not None:
                (layer, e), row = middle
                if not self.copier.copy_now((layer, self.local_of[e], row), FIRST_HALF):
                    raise self._read_error([middle[0]])
                middle_read = True
        finally:
            if submitted:
                ids = [copy_id for copy_id, _ in submitted]
                if not self.copier.wait(ids[-1]):
                    raise RuntimeError(f"expert cache: the copier did not run on-demand copies {ids}")
                self.copier.pause(True)
                self.copier.finished()  # collects the copier's failures up to the last of them
                failed = [key for copy_id, key in submitted if copy_id in self.copier.failed]
                self.copier.failed.difference_update(ids)
                made = [key for key, _ in theirs if key not in failed]  # experts written whole
                if middle_read and middle is not None and middle[0] not in failed:
                    made.append(middle[0])
                self.bytes_loaded[self.source.tier] += len(made) * self.expert_bytes
                if failed:
                    raise self._read_error(failed)

    def _load_beside_copy(self, layer: int, experts: Sequence[int]) -> CacheUpdate:
        """`load_on_demand` while a prefetch copy may be in progress: its row is being written, so
        its expert is no victim; only when the layer needs that row too (a cache barely larger than
        the layer's experts) does the forward wait for the copy."""
        while True:
            copying = tuple(c.key for c in self._queued)
            try:
                return load_on_demand(self.state, self.policy, layer, experts, protected=copying)
            except CacheTooSmallError:
                if not copying:
                    raise
            self._wait_for(self._queued[-1])

    def _count_lookups(self, layer: int, experts: Sequence[int]) -> None:
        """Layer `layer`'s `experts` were looked up; those published are hits."""
        hits = [e for e in experts if self.slot_of[layer, e] >= 0]
        self._count_hits(layer, hits)
        self.counters.lookups += len(experts) - len(hits)

    def _count_hits(self, layer: int, experts: Sequence[int]) -> None:
        """Layer `layer`'s `experts` were looked up and found resident (those prefetched and not
        used before were useful)."""
        self.counters.lookups += len(experts)
        self.counters.hits += len(experts)
        if self._unused_prefetches:
            used = self._unused_prefetches.intersection((layer, int(e)) for e in experts)
            self._unused_prefetches -= used
            self.counters.prefetches_useful += len(used)

    def warm(self, popularity: np.ndarray) -> int:
        """Fill free rows with this rank's most used experts by `popularity` [L, E] (the tokens an
        instance routed before a scale, all its ranks summed: `LLMEngine.expert_load`), before
        serving: a scale then leaves the least needed experts in the host tier, not whichever the
        first requests hit.
        A failed copy leaves its expert out (loaded on demand later). Returns the rows filled."""
        if popularity.shape != self.slot_of.shape:
            raise ValueError(f"warm: popularity is {popularity.shape}, the cache maps {self.slot_of.shape}")
        order = np.argsort(-popularity, axis=None, kind="stable")
        filled = 0
        with self._lock:
            self._drain_copier()
            try:
                for flat in order[: int((popularity > 0).sum())]:
                    layer, expert = divmod(int(flat), popularity.shape[1])
                    if self.state.is_full:
                        break
                    key = (layer, expert)
                    if expert not in self.local_of or self.state.is_resident(key):
                        continue
                    row = self._free.pop()
                    try:
                        self._copy(key, row)
                    except Exception:  # noqa: BLE001 - a warm start is an optimisation; on demand covers it
                        logger.exception("warming expert %s failed", key)
                        self._free.append(row)
                        continue
                    self._state = self.state.load([key])
                    self.slot_of[key] = row
                    filled += 1
            finally:
                self.counters.warm_loads += filled
                self._queue_plan()
                self.copier.pause(False)
        return filled

    # ---- prefetches (decided on the forward thread, copied by the copier) ---------------------

    def replan(self) -> None:
        """Take the policy's current plan (after it began an iteration, or observed a layer whose
        experts were then ensured: those stay protected) and queue its copies in place of the
        queued ones."""
        with self._lock:
            self._plan = self._policy_plan()
            self._publish_finished()
            self._queue_plan()

    def _policy_plan(self) -> PrefetchPlan | None:
        """The policy's plan; None (no prefetching until the next one) if it raises: a policy's
        fault costs hit rate, never a request.
        The policy sees the queued copies' experts as not resident: a plan leaves out what is
        resident, and the queued copies it still wants must be in it to stay queued."""
        try:
            # residency is all a plan reads (`OffloadPolicy.prefetch_plan`): the hits may wait
            state = self._state
            return self.policy.prefetch_plan(state.evict([c.key for c in self._queued]) if self._queued else state)
        except Exception:  # noqa: BLE001
            logger.exception("offload policy %s: prefetch_plan failed", self.policy.name)
            return None

    def _queue_plan(self) -> None:
        """Submit the plan's copies the cache does not hold or copy yet, each with its row: a free
        one, or the one of the policy's victim (never a protected, planned or queued expert). The
        queued copies stay when the plan still wants each of them (the plan after layer l mostly
        repeats the plan after layer l - 1, and a requeue costs the forward a victim search);
        otherwise they are cancelled first. Holds the lock."""
        if self._plan is None or self._closed:
            self._cancel_queued()
            return
        if not self._plan.items and not self._queued:
            return  # nothing to copy or cancel: the usual case once the cache holds the predictions
        plan = self._local_plan(self._plan)
        planned = plan.keys
        if self._queued:
            copying = self.copier.running()  # cancelling cannot stop that one, so it does not count
            if any(copy.key not in planned and copy.copy_id != copying for copy in self._queued):
                self._cancel_queued()
        if not plan.items:  # the usual case once the cache holds what the policy predicts
            return
        layer, experts = self._last_lookup
        protected = {(layer, int(e)) for e in experts}.union(c.key for c in self._queued)
        num_free = self.state.num_free
        try:
            update = run_prefetch(self.state, self.policy, plan, None, protected)
        except Exception:  # noqa: BLE001 - as in `_policy_plan`
            logger.exception("offload policy %s: choose_victims failed", self.policy.name)
            self._plan = None
            return
        if not update.loaded:
            return
        victims: list[ExpertKey | None] = [None] * min(num_free, len(update.loaded)) + list(update.evicted)
        rows = []
        for victim in victims:
            if victim is None:
                rows.append(self._free.pop())
            else:
                rows.append(int(self.slot_of[victim]))
                self.slot_of[victim] = -1  # its row is about to be written
        self._state = update.cache
        first = self.copier.submit([(layer, self.local_of[e], row) for (layer, e), row in zip(update.loaded, rows,
                                                                                              strict=True)])
        self._queued.extend(QueuedCopy(first + i, key, row, victim)
                            for i, (key, row, victim) in enumerate(zip(update.loaded, rows, victims, strict=True)))

    def _local_plan(self, plan: PrefetchPlan) -> PrefetchPlan:
        """The plan's experts this rank holds (under EP the policy also sees other ranks' experts)."""
        if all(item.expert in self.local_of for item in plan.items):
            return plan
        return PrefetchPlan(plan.after_layer, tuple(i for i in plan.items if i.expert in self.local_of))

    def _cancel_queued(self) -> None:
        """Drop the copies not started: each victim gets its row back (never written), or the row
        is free again. Holds the lock."""
        if not self._queued:
            return
        first = self.copier.cancel()
        while self._queued and self._queued[-1].copy_id >= first:
            copy = self._queued.pop()
            self._state = self.state.evict([copy.key])
            if copy.victim is None:
                self._free.append(copy.row)
            else:
                self._state = self.state.reinstate([copy.victim])
                self.slot_of[copy.victim] = copy.row
            self.counters.prefetches_cancelled += 1

    def _publish_finished(self) -> None:
        """Publish the copies the copier has finished (or discard the failed ones). Holds the lock."""
        if not self._queued:
            return
        finished = self.copier.finished()
        while self._queued and self._queued[0].copy_id < finished:
            copy = self._queued.popleft()
            if copy.victim is not None:  # gone for good: its row has been written
                self._count_eviction(copy.victim)
            if copy.copy_id in self.copier.failed:
                self.copier.failed.discard(copy.copy_id)
                self._state = self.state.evict([copy.key])
                self._free.append(copy.row)
                self.counters.prefetch_failures += 1
                continue
            self.slot_of[copy.key] = copy.row
            self.bytes_loaded[self.source.tier] += self.expert_bytes
            self.counters.prefetches += 1
            self._unused_prefetches.add(copy.key)

    def _drain_copier(self) -> None:
        """Pause the copier, cancel the queue and wait for the copy in progress: afterwards the
        queue is empty and nothing writes a row. The caller resumes the copier. Holds the lock."""
        self.copier.pause(True)
        self._cancel_queued()
        while self._queued:
            self._wait_for(self._queued[0])

    def _wait_for(self, copy: QueuedCopy) -> None:
        """Block until `copy` (in progress, or queued on a running copier) has finished, then publish."""
        if not self.copier.wait(copy.copy_id):
            raise RuntimeError(f"expert cache: prefetch copy {copy.copy_id} of {copy.key} will not run")
        self._publish_finished()

    def locked(self) -> threading.Lock:
        """The lock to hold around any other call into the policy (policies are not thread-safe)."""
        return self._lock

    def close(self) -> None:
        """Drop the queued copies, publish the one in progress once done, and stop the copier."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._plan = None
            self._drain_copier()
            self.copier.close()

    # ---- both ----------------------------------------------------------------------------

    def _copy(self, key: ExpertKey, row: int) -> None:
        """Copy `key` into `row` on this thread as the copier copies (by the source once closed)."""
        layer, expert = key
        if self._closed:
            self.source.copy_into(layer, self.local_of[expert], self.w13[row], self.w2[row])
        elif not self.copier.copy_now((layer, self.local_of[expert], row)):
            raise self._read_error([key])
        self.bytes_loaded[self.source.tier] += self.expert_bytes

    def _read_error(self, keys: list[ExpertKey]) -> OSError:
        return OSError(f"expert cache: reading experts {keys} from the {self.source.tier} tier failed")

    def _release(self, key: ExpertKey) -> None:
        """Evict `key` (resident, published) from the state and the map; its row becomes free."""
        row = int(self.slot_of[key])
        self.slot_of[key] = -1
        self._state = self.state.evict([key])
        self._free.append(row)
        self._count_eviction(key)

    def _count_eviction(self, key: ExpertKey) -> None:
        self.counters.evictions += 1
        if key in self._unused_prefetches:
            self._unused_prefetches.discard(key)
            self.counters.prefetches_wasted += 1

    def stats(self) -> dict[str, float | int | str]:
        with self._lock:
            self._publish_finished()
            c = self.counters
            return {
                "policy": self.policy.name, "tier": self.source.tier,
                "page_cache": "drop" if self.source.drops_pages else "keep",
                "capacity_experts": self.capacity, "expert_bytes": self.expert_bytes,
                "cache_bytes": self.capacity * self.expert_bytes, "resident_experts": self.state.num_resident,
                "lookups": c.lookups, "hits": c.hits, "hit_rate": round(c.hit_rate, 4),
                "on_demand_loads": c.on_demand_loads, "prefetches": c.prefetches,
                "prefetches_useful": c.prefetches_useful, "prefetches_wasted": c.prefetches_wasted,
                "prefetches_cancelled": c.prefetches_cancelled,
                "prefetch_failures": c.prefetch_failures, "evictions": c.evictions,
                "waits_for_prefetch": c.waits_for_prefetch, "warm_loads": c.warm_loads, "on_demand_s": round(c.on_demand_s, 6),
                "prefetch_s": round(self.copier.busy_s, 6),
                **{f"bytes_loaded_{tier}": n for tier, n in self.bytes_loaded.items()},
            }

    def check_integrity(self) -> None:
        """The map and the state agree and no row is used twice (tests and debug runs)."""
        with self._lock:
            self.state.check_integrity()
            rows = self.slot_of[self.slot_of >= 0]
            if len(set(rows.tolist())) != rows.size:
                raise AssertionError("expert cache: a pool row holds two experts")
            published = self.slot_of >= 0
            pending = {c.key for c in self._queued}
            mismatched = np.argwhere(published != self.state.resident)
            if any((int(layer), int(e)) not in pending for layer, e in mismatched):
                raise AssertionError("expert cache: map and state disagree")
            queued_rows = {c.row for c in self._queued}
            if queued_rows & set(rows.tolist()) or queued_rows & set(self._free):
                raise AssertionError("expert cache: a queued copy's row is also published or free")
            if rows.size + len(self._free) + len(queued_rows) != self.capacity:
                raise AssertionError("expert cache: rows lost")
