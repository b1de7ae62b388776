"""Liveness of the one-rank engine's ESFT disk tier (`engine.esft_disk_tier`): whatever the order of
arrivals, passes, admissions, preemptions and finishes, every request is served, and a running request always
holds its adapter's slot. A stand-in for the slots (names and slots only), the real scheduler and
tier, random events over more adapters than slots."""

from __future__ import annotations

import random

import pytest

from elasticmoe.engine.block_manager import BlockManager
from elasticmoe.engine.esft_disk_tier import EsftDiskTier
from elasticmoe.engine.request import AdapterBinding, Request
from elasticmoe.engine.scheduler import Scheduler
from elasticmoe.sampling_params import SamplingParams

EXPERTS = {0: (1,)}
MAX_LEN = 8  # tokens of a request, prompt and output


class FakeEsftSlots:
    """What the tier uses of `EsftSlots`: names, slots, load (a swap-in) and unload."""

    def __init__(self, max_adapters: int) -> None:
        self.max_adapters = max_adapters
        self.slot_of: dict[str, int] = {}

    @property
    def names(self) -> list[str]:
        return sorted(self.slot_of, key=self.slot_of.__getitem__)

    def index(self, name: str) -> int | None:
        return self.slot_of.get(name)

    def load(self, name: str, experts, expert_weights) -> int:
        assert name not in self.slot_of and len(self.slot_of) < self.max_adapters
        slot = min(set(range(self.max_adapters)) - set(self.slot_of.values()))
        self.slot_of[name] = slot
        return slot

    def unload(self, name: str) -> None:
        del self.slot_of[name]


class Files:
    def expert_weights(self, layer, expert, dtype=None):
        raise AssertionError("the stand-in slots read nothing")

    def close(self) -> None:
        pass


def bind(tier: EsftDiskTier, request: Request) -> None:
    """What `AdapterManager.bind` does for an ESFT request."""
    name = request.binding.name
    tier.note_arrival(name)
    slot = tier.slots.index(name)
    if slot is not None and tier.is_admitting(name):
        request.binding.esft_resident(slot)
    else:
        request.binding.wait()


@pytest.mark.parametrize("eviction", ["coserve", "lru", "fifo"])
def test_every_esft_request_is_served_whatever_the_order_of_events(eviction):
    rng = random.Random(eviction)
    preemptions = 0
    for trial in range(60):
        names = "abcde"
        declared = {n: rng.random() for n in names if rng.random() < 0.7}
        tier = EsftDiskTier(FakeEsftSlots(rng.randint(1, 3)), eviction, {}, declared)
        for n in names:
            tier.register(n, EXPERTS, Files())
        # A pool of 8 two-token blocks: requests that grow preempt each other (back to the queue,
        # still bound to their slots).
        sched = Scheduler(BlockManager(8, 2), max_num_batched_tokens=1000, max_num_seqs=rng.randint(1, 4),
                          window=rng.randint(1, 4))
        arrivals = [Request(f"{trial}-{i}", [5, 6], 2, SamplingParams(), 10_000,
                            binding=AdapterBinding(rng.choice(names), is_esft=True))
                    for i in range(rng.randint(5, 25))]
        arrivals.reverse()
        for _ in range(400):
            if arrivals and rng.random() < 0.6:
                request = arrivals.pop()
                bind(tier, request)
                sched.add(request)
            assert tier.swap_in(sched.waiting, sched.running) == []
            for r, n in sched.schedule().scheduled:  # the step: its tokens computed, one sampled
                r.num_computed_tokens += n
                r.token_ids.append(7)
                if r.num_tokens == MAX_LEN:  # its last token: done (the pool holds two such requests)
                    sched.finish(r)
            for r in list(sched.running):
                assert tier.slots.index(r.binding.name) == r.binding.esft_slot and not r.binding.is_waiting
                if rng.random() < 0.3:
                    sched.finish(r)
            if not arrivals and not sched.has_unfinished():
                preemptions += sched.num_preemptions
                break
        else:
            pytest.fail(f"trial {trial}: {len(sched.waiting)} requests never served; slots {tier.slots.slot_of}, "
                        f"evicting {tier.evicting}, waiting for {[r.binding.name for r in sched.waiting]}")
    assert preemptions > 0  # the pool is small enough to preempt
