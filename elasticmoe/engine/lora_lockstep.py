"""LoRA swaps under expert parallelism: every rank changes the same slots at the same round.

Under EP a token's experts live on other ranks, so a LoRA adapter must sit in the same slot on
every rank of the instance whenever a token of it is in flight; a rank cannot swap on its own
(`LoraSwapper` swaps per engine only with one rank). Instead, at a round boundary of the lockstep
loop (`imm.lockstep_loop`), each rank says what it wants (`wants`: the adapters of waiting
requests in its scheduling window that are in host memory only, and the slots its live requests
use); the loop gathers them over the instance's group; and every rank applies the same plan
(`apply`) from those global inputs alone:

- wanted adapters in ascending id (a hash of the name, the same on every rank) go to free slots
  first, else in place of a victim chosen by the configured eviction policy, where nothing
  rank-local enters the choice: usage probabilities from the profile or declared at load (not
  the observed rate), load and use times counted in rounds at which the whole group agreed;
- an adapter any rank's live request uses, or one made resident in this plan, is never evicted;
  one any rank's waiting requests need goes last (as `LoraSwapper` does with one rank);
- each rank then copies its own share of the factors (its experts') from host memory into the
  slot, at once, so the next step sees the same slots everywhere.

The registry beyond the slots (`--max-cpu-loras`) is each rank's host memory: every rank loads
every adapter (the coordinator loads them in the same order), so an id wanted anywhere is loaded
everywhere (an adapter leaves only once no rank has a live request of it).
"""

from __future__ import annotations

import zlib
from collections.abc import Collection, Iterable

from elasticmoe.adapter_policy.eviction import Residency, TierView, select_victims
from elasticmoe.adapter_policy.usage import needed_probability, usage_probabilities
from elasticmoe.engine.lora_swapper import LoraSwapper

NO_ID = -1  # padding of a rank's wanted ids


def adapter_id(name: str) -> int:
    """The id every rank gives adapter `name` (a 31-bit hash: collisions are refused at load)."""
    return zlib.crc32(name.encode()) & 0x7FFF_FFFF


class LockstepLora:
    """The lockstep swaps of one rank's `LoraSwapper` (see the module docstring)."""

    def __init__(self, swapper: LoraSwapper) -> None:
        self.swapper = swapper
        self.round = 0  # plans applied (the same count on every rank)
        self._loaded: dict[str, int] = {}  # adapter -> plan round it became resident
        self._used: dict[str, int] = {}  # adapter -> last plan round a live request used it

    @property
    def num_slots(self) -> int:
        return self.swapper.lora.max_loras

    def check_new(self, name: str) -> None:
        """Refuse an adapter whose id another loaded adapter has (a hash collision)."""
        taken = {adapter_id(n): n for n in self.swapper.lora.names}
        other = taken.get(adapter_id(name))
        if other is not None and other != name:
            raise ValueError(f"name: adapter {name!r} collides with {other!r}; choose another name")

    def wants(self, live: Iterable[Collection[str]]) -> tuple[list[int], list[int]]:
        """(ids of adapters this rank's scheduling window waits for, at most one per slot; slots the
        adapters of `live` requests occupy)."""
        swapper, lora = self.swapper, self.swapper.lora
        wanted: list[int] = []
        for r in swapper.scheduler.window_requests():
            if not r.binding.is_waiting:
                continue
            for name in sorted(r.binding.lora_names):
                ident = adapter_id(name)
                if lora.index(name) is None and lora.is_loaded(name) and ident not in wanted:
                    wanted.append(ident)
        used = sorted({s for names in live for n in names if (s := lora.index(n)) is not None})
        return wanted[: self.num_slots], used

    def queued_slots(self) -> list[int]:
        """Slots whose adapters this rank's waiting requests need (asked only in a round that plans
        swaps: it walks the whole queue)."""
        lora = self.swapper.lora
        return sorted({s for r in self.swapper.scheduler.waiting for n in r.binding.lora_names
                       if (s := lora.index(n)) is not None})

    def apply(self, wanted_ids: Iterable[int], used_slots: Collection[int],
              queued_slots: Collection[int] = ()) -> list[str]:
        """Make the wanted adapters resident, the same way on every rank; returns those swapped in.
        Waiting requests of a swapped-in adapter get its slot; those of a victim wait again."""
        swapper, lora = self.swapper, self.swapper.lora
        self.round += 1
        by_id = {adapter_id(n): n for n in lora.names}
        slot_names = {s: n for n, s in lora.slot_of.items()}
        for slot in used_slots:
            if slot in slot_names:
                self._used[slot_names[slot]] = self.round
        for resident_name in lora.slot_of:
            self._loaded.setdefault(resident_name, 0)
        pinned = {slot_names[s] for s in used_slots if s in slot_names}
        queued = {slot_names[s] for s in queued_slots if s in slot_names}
        swapped: list[str] = []
        for ident in sorted(set(wanted_ids) - {NO_ID}):
            found = by_id.get(ident)
            if found is None or lora.index(found) is not None:
                continue  # NOTE: unknown here means unloading everywhere: no rank loads it
            name = found
            free = lora.free_slots()
            if free:
                slot = free[0]
            else:
                victim = self._victim(pinned, queued)
                if victim is None:
                    break  # every slot serves a live request: the rest waits for the next plan
                slot = lora.evict(victim)
                self._loaded.pop(victim, None)
                for r in swapper.scheduler.waiting:
                    if victim in r.binding.lora_names:
                        r.binding.wait()
            lora.swap_in(name, slot)
            self._loaded[name] = self._used[name] = self.round
            pinned.add(name)
            swapped.append(name)
        for r in swapper.scheduler.waiting:
            if r.binding.is_waiting and set(swapped) & r.binding.lora_names:
                swapper.assign(r)
        return swapped

    def _victim(self, pinned: set[str], queued: set[str]) -> str | None:
        swapper, lora = self.swapper, self.swapper.lora
        base = swapper.tier_view(pinned, queued)
        # NOTE: only what every rank knows alike: no observed rates, times in agreed rounds.
        usage = usage_probabilities(base.graph.nodes, swapper.profiled, swapper.declared, {})
        resident = {n: Residency(self._loaded.get(n, 0), max(self._loaded.get(n, 0), self._used.get(n, 0)))
                    for n in lora.slot_of}
        resident.update({n: r for n, r in base.resident.items() if n not in lora.host})  # routers
        view = TierView(base.graph, resident, needed_probability(base.graph, usage), base.pinned, base.queued)
        victims = select_victims(swapper.policy, view, need=1)
        return victims[0] if victims else None
