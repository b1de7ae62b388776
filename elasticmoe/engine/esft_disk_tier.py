"""ESFT adapters beyond the slots of a one-rank engine (the single-process server): a registry on
disk, a hot set in the slots. The elastic server's counterpart is `coordinator.esft_residency`.

An ESFT adapter loaded while every slot (`--max-esft-adapters`) is taken is registered here: its
tuned experts and a reader of its rows from its files. It accepts requests at once; a request
for it waits (`AdapterBinding.wait`) and `swap_in`, called before every step, makes it resident
for the longest-waiting such request:

1. a slot is free: the adapter's rows are read from its files and written there (on the engine
   thread: that step waits for the read, a few milliseconds for a small model's experts), and
   every request waiting for it is bound to the slot;
2. else a victim among the resident adapters by the eviction policy (`--adapter-eviction`, CoServe
   §4.3: usage probability ascending, from the profile or the declaration, else the observed
   rate; or `lru`, `fifo`), adapters with running or queued requests last, never one swapped in
   for requests that have not run yet (else one slot would swap back and forth without
   progress). From then on the victim admits nothing: its queued and new requests wait like any
   other swapped-out adapter's. With none of its requests running it is released at once (step
   1 follows); else once they finish (only running requests hold it, so a queue never does).

Every resident adapter stays registered here, so a victim can come back. Not thread-safe: the
engine's thread calls it.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Protocol

import torch

from elasticmoe.adapter_policy.eviction import eviction_order, eviction_policy, slot_tier_view
from elasticmoe.adapters.esft_slots import EsftSlots
from elasticmoe.engine.request import Request

logger = logging.getLogger(__name__)


class RowSource(Protocol):
    """An adapter's files (`elasticmoe.adapters.esft.EsftAdapter`): its tuned experts' rows, read
    when asked; `close` lets go of the files until the next read (no file held open per
    registered adapter between swaps)."""

    def expert_weights(self, layer: int, expert: int,
                       dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]: ...

    def close(self) -> None: ...


@dataclass(frozen=True)
class OnDisk:
    """What a swap-in needs: the tuned experts (layer -> ids) and where their rows are read from."""

    experts: dict[int, tuple[int, ...]]
    files: RowSource


class EsftDiskTier:
    def __init__(self, slots: EsftSlots, eviction: str, profiled: Mapping[str, float],
                 declared: Mapping[str, float]) -> None:
        self.slots = slots
        self.policy = eviction_policy(eviction)
        self.profiled, self.declared = profiled, declared  # usage probabilities (declared: the manager's, live)
        self.registered: dict[str, OnDisk] = {}  # every adapter loaded through the tier, resident or not
        self.evicting: str | None = None  # resident, admits nothing, released once none of its requests runs
        self._fresh: set[str] = set()  # swapped in for requests that have not run yet: not evicted
        self._seq = itertools.count(1)
        self._loaded_seq: dict[str, int] = {}
        self._used_seq: dict[str, int] = {}
        self._num_requested: dict[str, int] = {}
        self.num_swaps_in = self.num_evictions = 0
        self.swap_s = 0.0

    def register(self, name: str, experts: dict[int, tuple[int, ...]], files: RowSource) -> None:
        self.registered[name] = OnDisk(dict(experts), files)

    def stats(self) -> dict[str, int]:
        return {"esft_slots": self.slots.max_adapters, "esft_resident": len(self.slots.slot_of),
                "esft_registered": len(self.registered), "esft_swaps_in": self.num_swaps_in,
                "esft_evictions": self.num_evictions, "esft_swap_us": int(self.swap_s * 1e6)}

    def is_admitting(self, name: str) -> bool:
        """A request for `name` may be bound to its slot now (resident and not being evicted)."""
        return self.slots.index(name) is not None and name != self.evicting

    def note_loaded(self, name: str) -> None:
        """`name` went into a slot (at registration, or swapped in)."""
        self._loaded_seq[name] = self._used_seq[name] = next(self._seq)

    def note_arrival(self, name: str) -> None:
        self._num_requested[name] = self._num_requested.get(name, 0) + 1
        self._used_seq[name] = next(self._seq)

    def forget(self, name: str) -> None:
        """`name` was unloaded (its slot, if any, released by the caller)."""
        self.registered.pop(name, None)
        for table in (self._loaded_seq, self._used_seq, self._num_requested):
            table.pop(name, None)
        if self.evicting == name:
            self.evicting = None
        self._fresh.discard(name)

    # ---- between steps -------------------------------------------------------------------------

    def swap_in(self, waiting: Iterable[Request], running: Iterable[Request]) -> list[tuple[Request, Exception]]:
        """One pass: release the evicting adapter once none of its requests runs, then make the
        adapter of the longest-waiting ESFT request resident (or start the eviction that frees a
        slot for it). Returns that adapter's waiting requests with the error if its rows could
        not be read (a file gone or damaged since registration): they fail, it stays registered."""
        waiting = list(waiting)
        in_use = _esft_adapters(running)
        # NOTE: fresh only while requests bound to it still wait to run (once they ran, or were
        # aborted before, it may go again: else an abandoned swap-in would pin its slot forever)
        self._fresh &= _esft_adapters(r for r in waiting if not r.binding.is_waiting)
        if self.evicting is not None and self.evicting not in in_use:
            self._release(self.evicting, waiting)
        pending = [r for r in waiting if r.binding.is_esft and r.binding.is_waiting]
        if not pending:
            return []
        name = pending[0].binding.name
        assert name is not None
        mine = [r for r in pending if r.binding.name == name]
        slot = self.slots.index(name)
        if slot is not None:  # the evicting one, and its waiters are the oldest now: keep it
            self.evicting = None
            for r in mine:
                r.binding.esft_resident(slot)
            return []
        if len(self.slots.slot_of) >= self.slots.max_adapters:
            if self.evicting is not None:
                return []  # one eviction at a time; its running requests are finishing
            victim = self._victim(in_use, _esft_adapters(waiting))
            if victim is None:
                return []  # every slot was just filled for requests that have not run yet
            self.num_evictions += 1
            self.evicting = victim  # its queued requests wait from now on, like its new ones
            for r in waiting:
                if r.binding.name == victim and r.binding.is_esft:
                    r.binding.wait()
            if victim in in_use:
                logger.info("esft: evicting %r for %r (%s) once its running requests finish", victim, name,
                            self.policy.name)
                return []
            self._release(victim, waiting)
        start = time.perf_counter()
        entry = self.registered[name]
        try:
            slot = self.slots.load(name, entry.experts, entry.files.expert_weights)
        except Exception as exc:  # noqa: BLE001 - its requests fail, the engine and the others go on
            logger.exception("esft: swapping %r in failed", name)
            return [(r, exc) for r in mine]
        finally:
            entry.files.close()
            self.swap_s += time.perf_counter() - start
        self.num_swaps_in += 1
        self.note_loaded(name)
        self._fresh.add(name)
        for r in mine:
            r.binding.esft_resident(slot)
        return []

    def _victim(self, in_use: set[str], queued: set[str]) -> str | None:
        """The policy's first choice among the resident adapters, those with requests running or
        queued last; never one swapped in for requests that have not run yet (None if all are)."""
        names = [n for n in self.slots.names if n not in self._fresh]
        if not names:
            return None
        view = slot_tier_view(names, self._loaded_seq, self._used_seq, self._num_requested, self.profiled,
                              self.declared, queued=frozenset(in_use | queued))
        return eviction_order(self.policy, view)[0]

    def _release(self, name: str, waiting: list[Request]) -> None:
        """Swap `name` out: its slot is free; a request of it still queued (preempted meanwhile)
        waits for it again."""
        if self.evicting == name:
            self.evicting = None
        for r in waiting:
            if r.binding.name == name and r.binding.is_esft:
                r.binding.wait()
        self.slots.unload(name)
        self._loaded_seq.pop(name, None)
        self._fresh.discard(name)
        logger.info("esft: adapter %r swapped out", name)


def _esft_adapters(requests: Iterable[Request]) -> set[str]:
    return {r.binding.name for r in requests if r.binding.is_esft and r.binding.name is not None}
