"""The engine's swapper under each eviction policy (CoServe §4.3 two-stage, LRU, FIFO): which
resident adapter a swap evicts, with a stand-in for the LoRA slots (names and slots only) and the
real scheduler."""

from __future__ import annotations

import random
from collections.abc import Callable
from types import SimpleNamespace

import pytest

from elasticmoe.adapters.lora_routing import VocabRouting
from elasticmoe.engine.block_manager import BlockManager
from elasticmoe.engine.lora_lockstep import NO_ID, PRELOAD_RETRY_ROUNDS, LockstepLora, adapter_id
from elasticmoe.engine.lora_swapper import LoraSwapper, router_node
from elasticmoe.engine.request import AdapterBinding, Request
from elasticmoe.engine.scheduler import Scheduler
from elasticmoe.sampling_params import SamplingParams


class FakeSlots:
    """What the swapper uses of `LoraSlots`: loaded names, slots, evict and a synchronous swap."""

    def __init__(self, max_loras: int, names: list[str]) -> None:
        self.max_loras = max_loras
        self.host = dict.fromkeys(names)
        self.slot_of: dict[str, int] = {}
        self.evicted: list[str] = []
        self.filling: dict[int, tuple[str, object]] = {}  # never: swaps here are synchronous
        self.num_preloads = 0
        self.failed_swaps: dict[str, BaseException] = {}
        for name in names[:max_loras]:  # loaded into free slots first, in order (as `LoraSlots.load`)
            self.slot_of[name] = len(self.slot_of)

    @property
    def names(self) -> list[str]:
        return list(self.host)

    def index(self, name: str) -> int | None:
        return self.slot_of.get(name)

    def is_loaded(self, name: str) -> bool:
        return name in self.host

    def is_filling(self, name: str) -> bool:
        return False

    def free_slots(self) -> list[int]:
        return sorted(set(range(self.max_loras)) - set(self.slot_of.values()))

    def finish_swaps(self) -> list[str]:
        return []

    def take_failed_swaps(self) -> dict[str, BaseException]:
        failed, self.failed_swaps = self.failed_swaps, {}
        return failed

    def evict(self, name: str) -> int:
        self.evicted.append(name)
        return self.slot_of.pop(name)

    def swap_in(self, name: str, slot: int) -> None:
        self.slot_of[name] = slot


class BackgroundFakeSlots(FakeSlots):
    """`FakeSlots` whose copies run in the background: a copy started is resident once a later
    `finish_swaps` reports it, which `done_after` (calls) decides."""

    def __init__(self, max_loras: int, names: list[str], done_after: Callable[[], int]) -> None:
        super().__init__(max_loras, names)
        self.done_after = done_after
        self.filling: dict[int, tuple[str, list[int]]] = {}  # slot -> (adapter, [finish_swaps calls left])

    def is_filling(self, name: str) -> bool:
        return any(n == name for n, _ in self.filling.values())

    def free_slots(self) -> list[int]:
        return sorted(set(super().free_slots()) - set(self.filling))

    def swap_in_async(self, name: str, slot: int) -> None:
        self.filling[slot] = (name, [self.done_after()])

    def finish_swaps(self, block: bool = False) -> list[str]:
        done = []
        for slot, (name, left) in list(self.filling.items()):
            left[0] -= 1
            if block or left[0] <= 0:
                del self.filling[slot]
                self.slot_of[name] = slot
                done.append(name)
        return done


def make_request(request_id: str, adapter: str | None = None, routing: VocabRouting | None = None) -> Request:
    return Request(request_id, [5, 6], 2, SamplingParams(), 10_000, binding=AdapterBinding(adapter, routing=routing))


def make_swapper(eviction: str = "coserve", names: str = "abc", slots: int = 2, routers=None, profiled=None,
                 declared: dict[str, float] | None = None, max_num_seqs: int = 8, window: int = 8,
                 background: Callable[[], int] | None = None) -> LoraSwapper:
    """`max_num_seqs=0`: nothing starts, every request stays in the queue. `background`: copies in
    the background, each done after that many `finish_swaps` calls."""
    sched = Scheduler(BlockManager(64, 4), max_num_batched_tokens=1000, max_num_seqs=max_num_seqs, window=window)
    lora = FakeSlots(slots, list(names)) if background is None else BackgroundFakeSlots(slots, list(names), background)
    swapper = LoraSwapper(lora, sched, can_swap_async=background is not None, eviction=eviction,
                          routers=lambda: routers or {}, profiled=profiled)
    swapper.async_swaps = background is not None  # whatever this host's cores would choose
    for name, p in (declared or {}).items():
        swapper.declare(name, p)
    return swapper


def submit(swapper: LoraSwapper, request: Request) -> Request:
    """What `AdapterManager.bind` and the engine do with a new request."""
    swapper.assign(request)
    for name in sorted(request.binding.lora_names):
        swapper.note_arrival(name)
    swapper.scheduler.add(request)
    return request


def run_once(swapper: LoraSwapper, *adapters: str) -> None:
    """A request for each adapter runs one step (marking it used), then finishes."""
    requests = [submit(swapper, make_request(f"run-{a}", a)) for a in adapters]
    swapper.swap_in()
    swapper.scheduler.schedule()
    swapper.swap_in()  # a pass while they run: they count as used
    for r in requests:
        swapper.scheduler.finish(r)


def evicted_for(swapper: LoraSwapper, adapter: str = "c") -> list[str]:
    request = submit(swapper, make_request(f"want-{adapter}", adapter))
    assert not request.is_ready
    swapper.swap_in()
    assert request.is_ready and swapper.lora.index(adapter) is not None
    return swapper.lora.evicted


@pytest.mark.parametrize("used, want", [
    ("ab", {"coserve": "b", "lru": "a", "fifo": "a"}),  # b used last
    ("ba", {"coserve": "b", "lru": "b", "fifo": "a"}),  # a used last
])
def test_each_policy_picks_its_victim(used, want):
    for policy, victim in want.items():
        swapper = make_swapper(policy, declared={"a": 0.7, "b": 0.1, "c": 0.2})
        run_once(swapper, *used[:1])
        run_once(swapper, *used[1:])
        assert evicted_for(swapper) == [victim], policy


def test_probability_sources_profile_then_declared_then_observed_rate():
    swapper = make_swapper(profiled={"a": 0.05}, declared={"a": 0.7, "b": 0.1})
    assert evicted_for(swapper) == ["a"]  # the profile says a is rarer than b's declaration
    # Nothing pre-assessed: the observed request rates decide (b was asked for more often, a
    # more recently: LRU would evict b).
    swapper = make_swapper()
    run_once(swapper, "b", "b", "b")
    run_once(swapper, "a")
    view = swapper.tier_view()
    assert view.probability("b") > view.probability("a") > view.probability("c") == 0.0
    assert evicted_for(swapper) == ["a"]


def test_a_router_makes_its_adapters_needed_with_its_requests():
    routers = {"r": SimpleNamespace(adapters=("b",))}
    declared = {"a": 0.3, "b": 0.1, "c": 0.1}
    assert evicted_for(make_swapper(declared=declared)) == ["b"]
    swapper = make_swapper(routers=routers, declared={**declared, router_node("r"): 0.5})
    assert swapper.tier_view().probability("b") == pytest.approx(0.6)
    assert swapper.tier_view().graph.predecessors("b") == {router_node("r")}
    assert evicted_for(swapper) == ["a"]


def test_adapters_needed_beside_the_incoming_one_and_queued_ones_go_last():
    # A per-token request mixes c with a: a stays resident although it is the least probable.
    swapper = make_swapper(declared={"a": 0.1, "b": 0.6, "c": 0.3})
    submit(swapper, make_request("mix", routing=VocabRouting((10,), ("c", "a"))))
    swapper.swap_in()
    assert swapper.lora.evicted == ["b"] and swapper.scheduler.waiting[0].is_ready
    # A younger request for a waits in the window: b goes although it is more probable.
    swapper = make_swapper(declared={"a": 0.1, "b": 0.6, "c": 0.3}, max_num_seqs=0)
    want = submit(swapper, make_request("want-c", "c"))
    submit(swapper, make_request("queued-a", "a"))
    swapper.swap_in()
    assert swapper.lora.evicted == ["b"] and want.is_ready


def test_an_adapter_with_requests_queued_behind_the_window_goes_last():
    # Window of one: c waits for a slot; a's request is queued behind the window (no room to
    # start). a is less probable than b, but b has no request: b goes, and a's request stays
    # ready. (Evicting a sent its request back to wait until the window reached it: under a
    # long queue the popular adapters' requests waited for the cold ones at its head.)
    swapper = make_swapper(declared={"a": 0.3, "b": 0.6, "c": 0.1}, max_num_seqs=0, window=1)
    want = submit(swapper, make_request("want-c", "c"))
    queued = submit(swapper, make_request("queued-a", "a"))
    swapper.swap_in()
    assert swapper.lora.evicted == ["b"] and want.is_ready and queued.is_ready


@pytest.mark.parametrize("eviction", ["coserve", "lru", "fifo"])
def test_a_request_whose_adapter_came_back_for_another_request_gets_its_slot(eviction):
    # One slot, a window of one, nothing starts. b's swap evicts a, and both of a's requests
    # wait. a comes back (a synchronous copy) for the first of them when it reaches the window;
    # the second, behind the window then, must get the slot too once it is resident. (It did not:
    # only the requests the copy was made for got their slots, and the other waited forever for
    # a copy that would never be made, since its adapter was resident: a stuck engine.)
    swapper = make_swapper(eviction, names="ab", slots=1, max_num_seqs=0, window=1)
    want_b = submit(swapper, make_request("want-b", "b"))
    first_a, second_a = (submit(swapper, make_request(f"a-{i}", "a")) for i in range(2))
    swapper.swap_in()
    assert want_b.is_ready and not first_a.is_ready and not second_a.is_ready
    swapper.scheduler.finish(want_b)
    swapper.swap_in()
    assert first_a.is_ready and swapper.lora.index("a") is not None
    swapper.scheduler.finish(first_a)
    swapper.swap_in()
    assert second_a.is_ready


def admit_check_and_finish_some(swapper, rng: random.Random) -> None:
    """One step of the randomised liveness tests: admit what may start; every running request must
    hold its adapter's slot; some of them finish."""
    sched = swapper.scheduler
    sched.schedule()
    for r in list(sched.running):
        assert swapper.lora.index(r.binding.name) == r.binding.lora_slot
        if rng.random() < 0.4:
            sched.finish(r)


@pytest.mark.parametrize("eviction", ["coserve", "lru", "fifo"])
@pytest.mark.parametrize("background", [False, True])
def test_every_request_is_served_whatever_the_order_of_events(eviction, background):
    # Liveness over random arrivals, passes, admissions, finishes, preloads and copy times: more
    # adapters than slots, small windows and batches. Every request must be served, and a request
    # admitted only with its adapter in its slot.
    rng = random.Random(f"{eviction}-{background}")
    for trial in range(40):
        names = "abcdef"
        declared = {n: rng.random() for n in names if rng.random() < 0.7}
        swapper = make_swapper(eviction, names=names, slots=rng.randint(1, 3), max_num_seqs=rng.randint(1, 4),
                               window=rng.randint(1, 4), declared=declared,
                               background=(lambda: rng.randint(1, 3)) if background else None)
        arrivals = [make_request(f"{trial}-{i}", rng.choice(names)) for i in range(rng.randint(5, 25))]
        arrivals.reverse()
        for _ in range(400):
            if arrivals and rng.random() < 0.6:
                submit(swapper, arrivals.pop())
            assert swapper.swap_in() == []
            admit_check_and_finish_some(swapper, rng)
            if rng.random() < 0.5:
                swapper.preload()
            if not arrivals and not swapper.scheduler.has_unfinished():
                break
        else:
            pytest.fail(f"trial {trial}: {len(swapper.scheduler.waiting)} requests never served; slots "
                        f"{swapper.lora.slot_of}, waiting for {[r.binding.name for r in swapper.scheduler.waiting]}")


def test_the_lockstep_plan_evicts_an_adapter_with_queued_requests_last():
    # Under EP every rank applies the same plan from gathered inputs: the slots some rank's waiting
    # requests need (here a's, slot 0) go last, though a is the least probable.
    swapper = make_swapper(declared={"a": 0.1, "b": 0.6, "c": 0.3})
    lockstep = LockstepLora(swapper)
    assert lockstep.apply({adapter_id("c")}, used_slots=set(), queued_slots={0}) == ["c"]
    assert swapper.lora.evicted == ["b"] and swapper.lora.slot_of == {"a": 0, "c": 1}
    # Without queued requests the probabilities decide: a goes.
    swapper = make_swapper(declared={"a": 0.1, "b": 0.6, "c": 0.3})
    assert LockstepLora(swapper).apply({adapter_id("c")}, used_slots=set()) == ["c"]
    assert swapper.lora.evicted == ["a"]
    # What a rank reports: the slots its waiting requests need, beside its wants.
    swapper = make_swapper(max_num_seqs=0)
    submit(swapper, make_request("queued-b", "b"))
    submit(swapper, make_request("want-c", "c"))
    assert LockstepLora(swapper).wants([]) == ([adapter_id("c")], [])
    assert LockstepLora(swapper).queued_slots() == [1]


def test_an_adapter_an_older_request_waits_for_stays_for_a_younger_requests_adapter():
    # Window: a (ready, not started: no room), c (waiting for a slot), b (ready, not started). a is
    # the least probable, but its request is older than c's: b goes. Without this rule a window
    # with more adapters than slots swaps them out and back forever.
    swapper = make_swapper(declared={"a": 0.1, "b": 0.6, "c": 0.3}, max_num_seqs=0)
    submit(swapper, make_request("queued-a", "a"))
    want = submit(swapper, make_request("want-c", "c"))
    submit(swapper, make_request("queued-b", "b"))
    swapper.swap_in()
    assert swapper.lora.evicted == ["b"] and want.is_ready
    assert not swapper.scheduler.waiting[2].is_ready  # b's request waits for b again
    # Every resident adapter is wanted by an older request: c waits.
    swapper = make_swapper(max_num_seqs=0)
    for rid, a in (("qa", "a"), ("qb", "b"), ("want-c", "c")):
        submit(swapper, make_request(rid, a))
    swapper.swap_in()
    assert swapper.lora.evicted == [] and not swapper.scheduler.waiting[2].is_ready


def test_nothing_is_evicted_under_running_requests_and_unloads_are_forgotten():
    swapper = make_swapper(declared={"a": 0.1})
    for a in "ab":
        submit(swapper, make_request(f"run-{a}", a))
    swapper.swap_in()
    swapper.scheduler.schedule()
    want = submit(swapper, make_request("want-c", "c"))
    swapper.swap_in()
    assert not want.is_ready and swapper.lora.evicted == []
    swapper.forget("a")
    assert "a" not in swapper.declared
    with pytest.raises(ValueError, match="adapter_eviction"):
        make_swapper("mru")
    with pytest.raises(ValueError, match="usage_probability"):
        swapper.declare("b", 1.5)


# ---- preloading (CoServe §4.1 while the server runs) -----------------------------------------


def test_a_hot_adapter_a_cold_request_displaced_comes_back_before_its_next_request():
    swapper = make_swapper(declared={"a": 0.5, "b": 0.4, "c": 0.05})
    assert evicted_for(swapper, "c") == ["b"]  # the cold request's swap evicts the less probable hot one
    assert swapper.preload() is None  # c's request still waits to run: c stays
    run_once(swapper)  # nothing; c's request is still queued
    swapper.scheduler.schedule()
    (request,) = swapper.scheduler.running
    assert swapper.preload() is None  # running: pinned
    swapper.scheduler.finish(request)
    # Idle now: b (0.4) displaces c (0.05), though c served a request, because no other adapter
    # is out of the slots (b is likelier than all of them together).
    assert swapper.preload() == "b"
    assert swapper.lora.slot_of == {"a": 0, "b": 1} and swapper.lora.evicted == ["b", "c"]
    assert swapper.lora.num_preloads == 1
    assert swapper.preload() is None  # c is less probable than both: nothing more to gain


def test_preloading_is_coserve_s_and_needs_a_pre_assessed_probability():
    swapper = make_swapper("lru", declared={"a": 0.1, "b": 0.1, "c": 0.8})
    assert swapper.preload() is None  # the baselines swap on demand only
    swapper = make_swapper()  # nothing declared: observed rates are no reason to copy ahead of requests
    for _ in range(3):
        run_once(swapper, "a")
    assert swapper.preload() is None
    swapper = make_swapper(declared={"a": 0.1, "b": 0.1}, profiled={"c": 0.8})  # a profile counts
    assert swapper.preload() == "c" and swapper.lora.evicted == ["a"]


def test_preloading_leaves_adapters_waiting_requests_need_and_those_being_unloaded():
    swapper = make_swapper(declared={"a": 0.1, "b": 0.2, "c": 0.8}, max_num_seqs=0)
    submit(swapper, make_request("queued-a", "a"))
    submit(swapper, make_request("queued-b", "b"))
    assert swapper.preload() is None  # both residents have a request waiting
    unloading = {"c"}
    swapper = make_swapper(declared={"a": 0.1, "b": 0.2, "c": 0.8})
    swapper.unloading = lambda: unloading
    assert swapper.preload() is None


def test_no_preload_while_a_window_request_waits_for_an_adapter():
    # c (0.6) would displace an idle, unused adapter, but d's request waits for a copy: demand first.
    swapper = make_swapper(names="abcd", declared={"a": 0.1, "b": 0.1, "c": 0.6, "d": 0.2}, max_num_seqs=0)
    want = submit(swapper, make_request("want-d", "d"))
    assert swapper.preload() is None and swapper.lora.evicted == []
    swapper.swap_in()  # d in, in place of a
    assert want.is_ready and swapper.lora.evicted == ["a"]
    assert swapper.preload() == "c" and swapper.lora.slot_of == {"d": 0, "c": 1}  # b was unused since its load


def test_a_declined_preload_is_not_decided_again_until_something_changes(monkeypatch):
    swapper = make_swapper(declared={"a": 0.5, "b": 0.4, "c": 0.3})
    calls = []
    decide = swapper.preload_decision
    monkeypatch.setattr(swapper, "preload_decision", lambda *args: calls.append(1) or decide(*args))
    assert swapper.preload() is None and swapper.preload() is None
    assert len(calls) == 1  # the same slots, candidate and idle adapters: the memo answers
    swapper.declare("c", 0.45)  # now c is worth b's slot
    assert swapper.preload() == "c" and len(calls) == 2


def lockstep_pair(declared: dict[str, float]) -> list[LockstepLora]:
    """Two ranks' lockstep swappers with the same adapters, slots and declarations."""
    return [LockstepLora(make_swapper(declared=declared)) for _ in range(2)]


def test_the_group_preloads_only_what_every_rank_proposes_at_one_registry_version():
    ranks = lockstep_pair({"a": 0.1, "b": 0.2, "c": 0.8})
    rows = [rank.row(rank.wants([])[0]) for rank in ranks]
    assert rows[0] == rows[1] and rows[0][0] < NO_ID  # c proposed by both
    for rank in ranks:
        assert rank.apply_gathered(rows, used_slots=set()) == ["c"]
        assert rank.swapper.lora.slot_of == {"b": 1, "c": 0} and rank.swapper.lora.num_preloads == 1
    # A rank that has not declared c yet (its load is still on the way) makes the versions differ.
    ranks = lockstep_pair({"a": 0.1, "b": 0.2, "c": 0.8})
    ranks[1].swapper.declare("c", 0.8)
    rows = [rank.row(rank.wants([])[0]) for rank in ranks]
    assert all(rank.apply_gathered(rows, used_slots=set()) == [] for rank in ranks)
    # A rank with a request waiting for an adapter proposes nothing: the demand goes first.
    ranks = lockstep_pair({"a": 0.1, "b": 0.2, "c": 0.8})
    submit(ranks[0].swapper, make_request("want-c", "c"))
    rows = [rank.row(rank.wants([])[0]) for rank in ranks]
    assert rows[0][0] == adapter_id("c") and rows[1][0] < NO_ID
    assert all(rank.apply_gathered(rows, used_slots=set()) == ["c"] for rank in ranks)
    assert all(rank.swapper.lora.num_preloads == 0 for rank in ranks)


@pytest.mark.parametrize("eviction", ["coserve", "lru", "fifo"])
def test_every_rank_of_the_group_serves_every_request_with_the_same_slots(eviction):
    # Liveness of the lockstep plan (what `imm.lockstep_loop` does each round, without the
    # collectives): two ranks, each with its own queue, random arrivals, admissions and finishes.
    # After every round both ranks hold the same adapters in the same slots (their experts'
    # factors must match), and every request is served.
    rng = random.Random(eviction)
    for trial in range(40):
        names = "abcdef"
        declared = {n: rng.random() for n in names if rng.random() < 0.3}  # the others: rates differ by rank
        slots, seqs, window = rng.randint(1, 3), rng.randint(1, 4), rng.randint(1, 4)
        ranks = [LockstepLora(make_swapper(eviction, names=names, slots=slots, declared=declared, max_num_seqs=seqs,
                                           window=window)) for _ in range(2)]
        for rank in ranks:
            rank.swapper.lockstep = True
        arrivals = [[make_request(f"{trial}-{k}-{i}", rng.choice(names)) for i in range(rng.randint(3, 12))]
                    for k in range(2)]
        for queue in arrivals:
            queue.reverse()
        for _ in range(400):
            for rank, queue in zip(ranks, arrivals, strict=True):
                if queue and rng.random() < 0.6:
                    submit(rank.swapper, queue.pop())
            wants = [rank.wants([r.binding.lora_names for r in (*rank.swapper.scheduler.running,
                                                                 *rank.swapper.scheduler.waiting)])
                     for rank in ranks]
            if any(wanted for wanted, _ in wants):
                rows = [rank.row(wanted) for rank, (wanted, _) in zip(ranks, wants, strict=True)]
                in_use = set().union(*(used for _, used in wants))
                queued = set().union(*(rank.queued_slots() for rank in ranks))
                used_since = set().union(*(rank.used_since_plan() for rank in ranks))
                for rank in ranks:
                    rank.apply_gathered(rows, in_use, queued, used_since)
            assert ranks[0].swapper.lora.slot_of == ranks[1].swapper.lora.slot_of
            for rank in ranks:
                rank.swapper.swap_in()  # the rank's own pass: assigns only, under lockstep
                admit_check_and_finish_some(rank.swapper, rng)
            if not any(arrivals) and not any(rank.swapper.scheduler.has_unfinished() for rank in ranks):
                break
        else:
            pytest.fail(f"trial {trial}: requests never served; slots {ranks[0].swapper.lora.slot_of}, waiting for "
                        f"{[[r.binding.name for r in rank.swapper.scheduler.waiting] for rank in ranks]}")


def test_a_preload_the_group_declines_is_not_proposed_again_for_a_while():
    ranks = lockstep_pair({"a": 0.1, "b": 0.2, "c": 0.8})
    rows = [rank.row(rank.wants([])[0]) for rank in ranks]
    # Every slot is used by a live request on some rank: nothing may go.
    assert all(rank.apply_gathered(rows, used_slots={0, 1}) == [] for rank in ranks)
    for _ in range(PRELOAD_RETRY_ROUNDS - 1):
        assert all(rank.wants([])[0] == [] for rank in ranks)
    rows = [rank.row(rank.wants([])[0]) for rank in ranks]
    assert all(row[0] < NO_ID for row in rows)
    assert all(rank.apply_gathered(rows, used_slots={1}) == ["c"] for rank in ranks)
    assert all(rank.swapper.lora.slot_of == {"b": 1, "c": 0} for rank in ranks)


def test_a_hot_adapter_stays_out_while_the_adapters_outside_the_slots_are_likelier_together():
    # Five adapters, two slots. c's request displaced b; b (0.3) is less likely to come next than
    # c, d and e together (0.45): bringing it back would more often be undone than used.
    swapper = make_swapper(names="abcde", declared={"a": 0.25, "b": 0.3, "c": 0.15, "d": 0.15, "e": 0.15})
    assert swapper.preload() is None  # a and b, unused yet, are the likeliest: nothing to gain
    run_once(swapper, "a")
    run_once(swapper, "b")
    assert evicted_for(swapper, "c") == ["a"]
    swapper.scheduler.schedule()
    swapper.scheduler.finish(swapper.scheduler.running[0])
    assert swapper.preload() is None and swapper.lora.slot_of == {"b": 1, "c": 0}


def test_the_group_counts_an_adapter_used_between_two_plans_as_used():
    # c (0.3) is not likelier than d and e together (0.3): it may only displace an adapter unused
    # since its load. a was used by a request that lived only between two plans, on rank 0.
    declared = {"a": 0.1, "b": 0.3, "c": 0.3, "d": 0.15, "e": 0.15}

    def group() -> list[LockstepLora]:
        return [LockstepLora(make_swapper(names="abcde", declared=declared)) for _ in range(2)]

    ranks = group()
    ranks[0].wants([{"a"}])  # a round in which rank 0's live request held a's slot
    rows = [rank.row(rank.wants([])[0]) for rank in ranks]
    used_since = set().union(*(rank.used_since_plan() for rank in ranks))
    assert used_since == {0}
    assert all(rank.apply_gathered(rows, set(), set(), used_since) == [] for rank in ranks)
    assert all(rank.used_since_plan() == [] for rank in ranks)  # a plan starts the count again
    ranks = group()  # the same without that request: a, unused since its load, makes way
    rows = [rank.row(rank.wants([])[0]) for rank in ranks]
    assert all(rank.apply_gathered(rows, set()) == ["c"] for rank in ranks)
    assert all(rank.swapper.lora.slot_of == {"b": 1, "c": 0} for rank in ranks)


def test_slot_copies_go_to_a_thread_only_where_it_has_a_core(monkeypatch):
    import os

    import torch

    from elasticmoe.engine.lora_swapper import copier_has_a_core

    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(2)))
    assert not copier_has_a_core()  # 2 vCPUs, one compute thread per rank: the step thread copies
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(3)))
    assert copier_has_a_core()
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    assert not copier_has_a_core()
