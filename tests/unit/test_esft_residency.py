"""`EsftResidency`'s decisions without Ray: which resident adapter a swap evicts under each policy
(CoServe's usage probability, LRU, FIFO), that adapters made resident moments ago, or swapped in
for requests that have not reached a rank yet, are not evicted and running ones go last, and the
step order (finish an eviction, wait for a scale, load)."""

from __future__ import annotations

import asyncio
import threading
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import pytest
from ray.exceptions import GetTimeoutError

from coordinator import esft_residency
from coordinator.adapters import AdapterState
from coordinator.esft_residency import EsftResidency
from elasticmoe.errors import UnknownAdapterError


@dataclass
class _Events:
    running: Any = None


@dataclass
class _Cluster:
    scale_events: _Events = field(default_factory=_Events)
    active: Any = object()


class FakeHost:
    """Slots 0..n-1; what a swap does to the ranks and the HMM is recorded."""

    def __init__(self, num_slots: int) -> None:
        self.adapters: dict[str, AdapterState] = {}
        self.lock = threading.Lock()
        self.cluster = _Cluster()
        self.num_slots = num_slots
        self.log: list[tuple[str, str]] = []

    def free_esft_slot(self) -> int | None:
        taken = {a.slot for a in self.adapters.values() if a.slot is not None}
        return next((i for i in range(self.num_slots) if i not in taken), None)

    def load_into(self, entry: AdapterState, slot: int) -> None:
        entry.slot = slot
        self.log.append(("load", entry.name))

    def stop_admitting(self, name: str) -> None:
        self.log.append(("stop", name))

    def release_everywhere(self, name: str, inst: Any) -> None:
        self.log.append(("release", name))

    def publish_registry(self) -> None:
        self.log.append(("publish", ""))


def _setup(policy: str, resident: dict[str, float | None], on_disk: tuple[str, ...] = ("new",),
           in_use: frozenset[str] = frozenset()) -> tuple[FakeHost, EsftResidency]:
    host = FakeHost(len(resident))
    residency = EsftResidency(host, policy, min_resident_s=0.0, poll_s=0.001)  # type: ignore[arg-type]
    residency._in_use = lambda name: name in in_use  # type: ignore[method-assign]
    residency._admitted = lambda name: True  # type: ignore[method-assign]
    for slot, (name, p) in enumerate(resident.items()):
        host.adapters[name] = AdapterState(name, slot, f"/a/{name}", {0: (1,)}, usage_probability=p)
        residency.on_resident(name)
    for name in on_disk:
        host.adapters[name] = AdapterState(name, None, f"/a/{name}", {0: (1,)}, usage_probability=0.05)
    return host, residency


def _victim(policy: str, resident: dict[str, float | None], **kw: Any) -> str:
    host, residency = _setup(policy, resident, **kw)
    asyncio.run(residency.make_resident("new"))
    released = [name for what, name in host.log if what == "release"]
    assert host.log == [("stop", released[0]), ("release", released[0]), ("load", "new"), ("publish", "")]
    assert host.adapters[released[0]].slot is None and host.adapters["new"].slot is not None
    return released[0]


def test_coserve_evicts_the_least_probable_lru_the_least_recent_fifo_the_first_loaded():
    resident = {"a": 0.5, "b": 0.1, "c": 0.3}  # loaded a, b, c in that order
    assert _victim("coserve", resident) == "b"
    host, residency = _setup("lru", resident)
    residency.note_used({"a": 1})  # b, then c, then a by last use
    asyncio.run(residency.make_resident("new"))
    assert ("release", "b") in host.log
    host, residency = _setup("fifo", resident)
    residency.note_used({"a": 5})
    asyncio.run(residency.make_resident("new"))
    assert ("release", "a") in host.log


def test_without_declarations_the_observed_rate_decides():
    host, residency = _setup("coserve", {"a": None, "b": None})
    residency.note_used({"a": 1, "b": 9})
    asyncio.run(residency.make_resident("new"))
    assert ("release", "a") in host.log


def test_running_adapters_go_last_and_fresh_ones_not_at_all():
    assert _victim("coserve", {"a": 0.5, "b": 0.1}, in_use=frozenset({"b"})) == "a"
    host, residency = _setup("coserve", {"a": 0.5, "b": 0.1})
    residency.min_resident_s = 60.0
    residency.resident_at["a"] = 0.0  # long ago; b just now
    asyncio.run(residency.make_resident("new"))
    assert ("release", "a") in host.log


def test_an_adapter_swapped_in_for_waiting_requests_stays_until_one_reached_a_rank():
    """However slow the way from swap to rank: a timer alone would let two adapters through one
    slot evict each other before either's requests arrive, for ever."""
    host, residency = _setup("coserve", {}, on_disk=("a", "b"))
    host.num_slots = 1
    arrived: set[str] = set()
    residency._admitted = lambda name: name in arrived  # type: ignore[method-assign]

    async def main() -> None:
        await residency.make_resident("a")  # swapped in for a waiting request
        swap_b = asyncio.ensure_future(residency.make_resident("b"))
        await asyncio.sleep(0.2)  # min_resident_s is 0: only a's request's way protects it
        assert host.adapters["a"].slot == 0 and ("stop", "a") not in host.log
        arrived.add("a")
        await asyncio.wait_for(swap_b, 1.0)

    asyncio.run(main())
    assert [e for e in host.log if e[0] != "publish"] == [("load", "a"), ("stop", "a"), ("release", "a"), ("load", "b")]
    # Its waiters gave up (clients gone): the slot is given up after `reach_wait_s`.
    residency.reach_wait_s = 0.1
    arrived.clear()
    asyncio.run(asyncio.wait_for(residency.make_resident("a"), 1.0))
    assert host.adapters["a"].slot == 0 and host.adapters["b"].slot is None


def test_an_adapter_whose_waiters_are_all_gone_is_not_held_for_them():
    """Every ingress that asked for the swap says its waiters left (clients gone during the swap):
    the slot goes to the next swap at once, not after `reach_wait_s`; while one asker has not said
    so, the adapter stays held."""
    host, residency = _setup("coserve", {}, on_disk=("a", "b"))
    host.num_slots = 1
    residency.reach_wait_s = 60.0
    residency._admitted = lambda name: False  # type: ignore[method-assign]  # no request ever arrives

    async def main() -> None:
        await asyncio.gather(residency.make_resident("a"), residency.make_resident("a"))  # two ingresses
        swap_b = asyncio.ensure_future(residency.make_resident("b"))
        residency.unwanted("a")  # the first ingress's waiters are gone
        await asyncio.sleep(0.2)
        assert host.adapters["a"].slot == 0 and not swap_b.done()  # the second's may still come
        residency.unwanted("a")
        await asyncio.wait_for(swap_b, 1.0)

    asyncio.run(main())
    assert [e for e in host.log if e[0] != "publish"] == [("load", "a"), ("stop", "a"), ("release", "a"), ("load", "b")]
    assert residency.num_unwanted == 1 and "a" not in residency.askers
    residency.unwanted("b")  # b's only asker: nothing held any more, and nothing else changes
    residency.unwanted("b")  # a late or repeated report is harmless
    assert residency.awaited == set() and host.adapters["b"].slot == 0


def test_adapters_resident_from_registration_are_not_held_for_requests():
    host, residency = _setup("coserve", {"a": 0.1})
    residency._admitted = lambda name: False  # type: ignore[method-assign]  # no request ever came
    asyncio.run(asyncio.wait_for(residency.make_resident("new"), 1.0))
    assert ("release", "a") in host.log


def test_an_eviction_waits_for_the_victims_requests_and_no_swap_runs_during_a_scale():
    host, residency = _setup("coserve", {"a": 0.1})
    busy = {"a"}
    residency._in_use = lambda name: name in busy  # type: ignore[method-assign]

    async def main() -> None:
        swap = asyncio.ensure_future(residency.make_resident("new"))
        await asyncio.sleep(0.05)
        assert host.log == [("stop", "a")] and host.adapters["a"].evicting  # its request still runs
        host.cluster.scale_events.running = "scale-1"
        busy.clear()
        await asyncio.sleep(0.05)
        assert host.log == [("stop", "a"), ("release", "a")]  # finished, but nothing loads during the scale
        host.cluster.scale_events.running = None
        await swap

    asyncio.run(main())
    assert host.log[-2:] == [("load", "new"), ("publish", "")] and residency.num_evictions == residency.num_swaps_in == 1
    assert residency.swap_s >= 0.1  # the swap's time includes waiting for the victim's request and the scale


def test_an_unknown_or_unloading_adapter_is_refused():
    host, residency = _setup("coserve", {"a": 0.1})
    with pytest.raises(UnknownAdapterError):
        asyncio.run(residency.make_resident("nobody"))
    host.adapters["new"].state = "unloading"
    with pytest.raises(UnknownAdapterError):
        asyncio.run(residency.make_resident("new"))
    asyncio.run(residency.make_resident("a"))  # resident: nothing to do
    assert host.log == []


class _Rank:
    """A rank actor's handle whose `.remote` calls answer from a table (through a patched `ray.get`)."""

    def __init__(self, in_use: bool, admitted: int) -> None:
        self.answers = {"adapter_in_use": in_use, "adapter_admitted": admitted}

    def __getattr__(self, method: str) -> Any:
        return SimpleNamespace(remote=lambda name: self.answers[method])


def test_the_rank_probes_answer_for_every_rank_and_treat_an_unanswering_rank_safely(monkeypatch):
    host, residency = _setup("coserve", {"a": 0.1})
    residency = EsftResidency(host, "coserve")  # type: ignore[arg-type]  # the real probes
    host.cluster.active = SimpleNamespace(ranks=[_Rank(False, 0), _Rank(True, 2)])
    asked: list[float] = []

    def get(answers: list, timeout: float) -> list:
        asked.append(timeout)
        return answers

    monkeypatch.setattr(esft_residency.ray, "get", get)
    assert residency._in_use("a") and residency._admitted("a") and asked == [esft_residency.RANK_ANSWER_S] * 2
    host.cluster.active = SimpleNamespace(ranks=[_Rank(False, 0), _Rank(False, 0)])
    assert not residency._in_use("a") and not residency._admitted("a")

    def hung(answers: list, timeout: float) -> list:  # a rank that does not answer (hung, or dead)
        raise GetTimeoutError("no answer")

    monkeypatch.setattr(esft_residency.ray, "get", hung)
    # In use: the eviction waits and asks again; not admitted: the adapter stays (at most reach_wait_s).
    assert residency._in_use("a") and not residency._admitted("a")
    host.cluster.active = None
    assert residency._in_use("a") and not residency._admitted("a")
