"""LoRA swaps under expert parallelism: every rank changes the same slots at the same round.

Under EP a token's experts live on other ranks, so a LoRA adapter with factors on the experts must
sit in the same slot on every rank of the instance whenever a token of it is in flight; a rank
cannot swap on its own (`LoraSwapper` swaps per engine only with one rank, or when the slots hold
attention modules only: `AdapterManager.lora_in_lockstep`). Instead, at a round boundary of the lockstep
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

Preloading (CoServe §4.1 while the server runs, `adapter_policy.preload`): a rank with nothing to
wait for proposes the most probable adapter out of the slots (`preload_candidate`), beside its
registry version (declarations and forgets so far). Only when every rank proposes the same adapter
at the same version, so that each has loaded it and all know the same probabilities, does the
plan copy it in, into a free slot or in place of a strictly less probable adapter no rank's live
or waiting request needs (and, unless the adapter is likelier than all others out of the slots
together, that no rank used since its load: each rank reports the slots its live requests held in
any round since the last plan). A proposal the gathered inputs decline is not made again for
`PRELOAD_RETRY_ROUNDS` rounds (a preload costs no round of its own until then).

The registry beyond the slots (`--max-cpu-loras`) is each rank's host memory: every rank loads
every adapter (the coordinator loads them in the same order), so an id wanted anywhere is loaded
everywhere (an adapter leaves only once no rank has a live request of it).
"""

from __future__ import annotations

import zlib
from collections.abc import Collection, Iterable

from elasticmoe.adapter_policy.eviction import Residency, select_victims
from elasticmoe.engine.lora_swapper import LoraSwapper

NO_ID = -1  # padding of a rank's wanted ids
PRELOAD_RETRY_ROUNDS = 16  # rounds without a proposal after the group declined one


def adapter_id(name: str) -> int:
    """The id every rank gives adapter `name` (a 31-bit hash: collisions are refused at load)."""
    return zlib.crc32(name.encode()) & 0x7FFF_FFFF


def _proposal(ident: int) -> int:
    """A preload proposal of adapter id `ident` among the wanted ids: negative, below `NO_ID`
    (and its own inverse)."""
    return NO_ID - 1 - ident


class LockstepLora:
    """The lockstep swaps of one rank's `LoraSwapper` (see the module docstring)."""

    def __init__(self, swapper: LoraSwapper) -> None:
        self.swapper = swapper
        self.round = 0  # plans applied (the same count on every rank)
        self._loaded: dict[str, int] = {}  # adapter -> plan round it became resident
        self._used: dict[str, int] = {}  # adapter -> last plan round a live request used it
        self._rounds = 0  # `wants` calls: one per round of the loop, on every rank
        self._used_since_plan: set[int] = set()  # slots this rank's live requests used since the last plan
        self._quiet_until = 0  # no preload proposal before this round (the group declined one)

    @property
    def gather_width(self) -> int:
        """Entries of a rank's row in the gather: its wanted ids (padded with `NO_ID`), then its
        registry version."""
        return self.num_slots + 1

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
        """(ids of adapters this rank's scheduling window waits for, at most one per slot, or else
        a preload proposal; slots the adapters of `live` requests occupy)."""
        swapper, lora = self.swapper, self.swapper.lora
        self._rounds += 1
        wanted: list[int] = []
        for r in swapper.scheduler.window_requests():
            if not r.binding.is_waiting:
                continue
            for name in sorted(r.binding.lora_names):
                ident = adapter_id(name)
                if lora.index(name) is None and lora.is_loaded(name) and ident not in wanted:
                    wanted.append(ident)
        used = sorted({s for names in live for n in names if (s := lora.index(n)) is not None})
        self._used_since_plan.update(used)
        if not wanted and swapper.preloads and self._rounds >= self._quiet_until:
            best = swapper.preload_candidate()
            if best is not None:
                wanted = [_proposal(adapter_id(best))]
        return wanted[: self.num_slots], used

    def row(self, wanted: list[int]) -> list[int]:
        """This rank's row of the gather (`gather_width` entries)."""
        return (wanted + [NO_ID] * self.num_slots)[: self.num_slots] + [self.swapper.registry_version]

    def used_since_plan(self) -> list[int]:
        """Slots this rank's live requests used in any round since the last plan (slots change only
        at plans, so each still holds the adapter that was used): a request that started and ended
        between two plans counts, for the preload's rule on adapters unused since their load."""
        return sorted(self._used_since_plan)

    def apply_gathered(self, rows: list[list[int]], used_slots: Collection[int],
                       queued_slots: Collection[int] = (), used_since_plan: Collection[int] = ()) -> list[str]:
        """`apply` from every rank's `row`: the wanted ids of all, and a preload only where every
        rank proposed the same adapter at the same registry version."""
        wanted = {i for row in rows for i in row[:-1] if i > NO_ID}
        proposals = {i for row in rows for i in row[:-1] if i < NO_ID}
        unanimous = (len(proposals) == 1 and all(any(i < NO_ID for i in row[:-1]) for row in rows)
                     and len({row[-1] for row in rows}) == 1)
        preload = _proposal(proposals.pop()) if unanimous and not wanted else None
        return self.apply(wanted, used_slots, queued_slots, preload, used_since_plan)

    def queued_slots(self) -> list[int]:
        """Slots whose adapters this rank's waiting requests need (asked only in a round that plans
        swaps: it walks the whole queue)."""
        lora = self.swapper.lora
        return sorted({s for r in self.swapper.scheduler.waiting for n in r.binding.lora_names
                       if (s := lora.index(n)) is not None})

    def apply(self, wanted_ids: Iterable[int], used_slots: Collection[int],
              queued_slots: Collection[int] = (), preload: int | None = None,
              used_since_plan: Collection[int] = ()) -> list[str]:
        """Make the wanted adapters resident, the same way on every rank; returns those swapped in.
        Waiting requests of a swapped-in adapter get its slot; those of a victim wait again.
        `preload`: the id every rank proposed to preload (see the module docstring);
        `used_since_plan`: slots any rank's live requests used since the last plan."""
        swapper, lora = self.swapper, self.swapper.lora
        self.round += 1
        self._used_since_plan = set()
        by_id = {adapter_id(n): n for n in lora.names}
        slot_names = {s: n for n, s in lora.slot_of.items()}
        for slot in {*used_slots, *used_since_plan}:
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
        if preload is not None and not swapped:
            swapped = self._preload(by_id.get(preload), pinned, queued)
        for r in swapper.scheduler.waiting:
            if r.binding.is_waiting and set(swapped) & r.binding.lora_names:
                swapper.assign(r)
        return swapped

    def _preload(self, name: str | None, pinned: set[str], queued: set[str]) -> list[str]:
        """Copy `name` in if the gathered inputs allow (`LoraSwapper.preload_decision` with the
        residency in agreed rounds); else propose nothing for a while, on every rank alike."""
        swapper, lora = self.swapper, self.swapper.lora
        choice = None
        if name is not None and lora.index(name) is None:
            choice = swapper.preload_decision(name, self._residency(), pinned, queued)
        if choice is None:
            self._quiet_until = self._rounds + PRELOAD_RETRY_ROUNDS
            return []
        name, victim = choice
        slot = lora.free_slots()[0] if victim is None else lora.evict(victim)
        if victim is not None:
            self._loaded.pop(victim, None)
        lora.swap_in(name, slot)
        lora.num_preloads += 1
        self._loaded[name] = self._used[name] = self.round
        return [name]

    def _residency(self) -> dict[str, Residency]:
        """Each resident adapter's load and last use, in plan rounds (the same on every rank)."""
        return {n: Residency(self._loaded.get(n, 0), max(self._loaded.get(n, 0), self._used.get(n, 0)))
                for n in self.swapper.lora.slot_of}

    def _victim(self, pinned: set[str], queued: set[str]) -> str | None:
        # NOTE: only what every rank knows alike: no observed rates, times in agreed rounds.
        view = self.swapper.tier_view(pinned, queued, residency=self._residency(), observed_rates=False)
        victims = select_victims(self.swapper.policy, view, need=1)
        return victims[0] if victims else None
