"""Which LoRA slot each waiting request gets, and which adapters to swap into the hot set.

The engine's LoRA policy between steps (MoLoRA §5.2 hot set, CoServe §4.2-4.3):
a request whose adapters are resident gets their slots; the adapters of waiting
requests inside the scheduling window that are only in host memory are copied into
a free slot, else in place of the resident adapter with the lowest expected use (its
request rate plus its queued requests) that no running request needs. Copies run on
a background thread where the engine allows it (not under EP: there every loaded
adapter is resident); the waiting requests get their slots once the copy is done.
"""

from __future__ import annotations

import torch

from elasticmoe.adapters.lora_slots import LoraSlots
from elasticmoe.engine.request import Request
from elasticmoe.engine.scheduler import Scheduler


class LoraSwapper:
    def __init__(self, lora: LoraSlots, scheduler: Scheduler, can_swap_async: bool) -> None:
        self.lora = lora
        self.scheduler = scheduler
        self.can_swap_async = can_swap_async
        self.async_swaps = True  # copy adapters into slots on a background thread (when it can)
        self._arrivals: dict[str, int] = {}  # adapter -> requests since the last swap pass

    def note_arrival(self, adapter: str) -> None:
        self._arrivals[adapter] = self._arrivals.get(adapter, 0) + 1

    def assign(self, request: Request) -> None:
        """Give a request its slot(s) if its adapters are resident now, else make it wait.
        A per-token request gets each range's slot, once all of them are resident."""
        lora, binding = self.lora, request.binding
        if binding.routing is not None:
            slots = [-1 if n is None else lora.index(n) for n in binding.routing.adapters]
            if any(s is None for s in slots):
                binding.wait()
            else:
                binding.per_token(torch.tensor(slots, dtype=torch.long))
            return
        assert binding.name is not None
        slot = lora.index(binding.name)
        if slot is None:
            binding.wait()
        else:
            binding.resident(slot)

    def swap_in(self) -> None:
        """One pass between steps: assign arrived adapters, start the swaps the window needs."""
        lora = self.lora
        lora.note_requests(self._arrivals)
        self._arrivals = {}
        waiting = self.scheduler.waiting
        # Swap in only for the scheduling window (the requests admission looks at next, CoServe §4.2).
        window = {id(r) for r in self.scheduler.window_requests()}
        arrived = set(lora.finish_swaps())  # background copies that completed since the last step
        pending: dict[str, list[Request]] = {}  # non-resident adapter -> waiting requests needing it
        for r in waiting:
            if r.binding.is_waiting:
                if arrived & r.binding.lora_names:
                    self.assign(r)
                    if not r.binding.is_waiting:
                        continue
                if id(r) not in window:
                    continue
                for name in sorted(r.binding.lora_names):
                    if lora.index(name) is None and not lora.is_filling(name):
                        pending.setdefault(name, []).append(r)
        if not pending:
            return
        # NOTE: adapters that just became resident are not evicted before their requests ran once
        # (else a one-slot hot set would swap them out again at once, forever).
        busy = set().union(arrived, *(r.binding.lora_names for r in self.scheduler.running))
        queued: dict[str, int] = {}
        for r in waiting:
            for name in r.binding.lora_names:
                queued[name] = queued.get(name, 0) + 1
        for name, requests in pending.items():  # the adapter of the longest-waiting request first
            free = lora.free_slots()
            if free:
                slot = free[0]
            else:
                victim = lora.victim(busy, queued)
                if victim is None:
                    return  # every slot serves running requests: wait for one to finish
                slot = lora.evict(victim)
                for r in waiting:
                    if victim in r.binding.lora_names:
                        r.binding.wait()
            busy.add(name)  # not evicted again in this pass
            if self.can_swap_async and self.async_swaps:
                lora.swap_in_async(name, slot)  # its requests wait until `finish_swaps` reports it
                continue
            lora.swap_in(name, slot)
            for r in requests:
                self.assign(r)
