"""Admission grouped by LoRA adapter inside the scheduling window (CoServe §4.2): pure scheduler
logic with hand-made requests (adapter names, ready or waiting for a swap)."""

from __future__ import annotations

import pytest

from elasticmoe.config import EngineConfig
from elasticmoe.engine.block_manager import BlockManager
from elasticmoe.engine.request import AdapterBinding, Request, RequestStatus
from elasticmoe.engine.scheduler import Scheduler
from elasticmoe.sampling_params import SamplingParams


def make_request(request_id: str, adapter: str | None = None, ready: bool = True, esft: bool = False,
                 num_prompt: int = 2) -> Request:
    """A LoRA request for `adapter` (slot 0, or waiting for its swap), an ESFT one, or a base one."""
    binding = AdapterBinding(adapter, esft_slot=0 if esft else -1, is_esft=esft)
    if adapter is not None and not esft and ready:
        binding.resident(0)
    elif adapter is not None and not esft:
        binding.wait()
    return Request(request_id, list(range(num_prompt)), num_prompt, SamplingParams(), 10_000, binding=binding)


def make_scheduler(*requests: Request, window: int = 16, max_num_seqs: int = 64, num_blocks: int = 256,
                   arranging: str = "coserve") -> Scheduler:
    sched = Scheduler(BlockManager(num_blocks, 4), max_num_batched_tokens=10_000, max_num_seqs=max_num_seqs,
                      window=window, arranging=arranging)
    for r in requests:
        sched.add(r)
    return sched


def scheduled_ids(sched: Scheduler) -> list[str]:
    return [r.request_id for r, _ in sched.schedule().scheduled]


def waiting_ids(sched: Scheduler) -> list[str]:
    return [r.request_id for r in sched.waiting]


def finish_running(sched: Scheduler) -> None:
    for r in list(sched.running):
        sched.finish(r)


def test_window_groups_requests_by_adapter_in_order_of_their_oldest_request():
    sched = make_scheduler(make_request("a0", "A"), make_request("b0", "B"), make_request("base0"),
                           make_request("a1", "A"), make_request("b1", "B"), make_request("base1"), max_num_seqs=4)
    assert scheduled_ids(sched) == ["a0", "a1", "b0", "b1"]
    assert waiting_ids(sched) == ["base0", "base1"]  # the rest keep their order
    assert scheduled_ids(make_scheduler(*(make_request(f"{a}{i}", a) for i in range(3) for a in "AB"))) == [
        "A0", "A1", "A2", "B0", "B1", "B2"]
    assert sched.arrange_s > 0  # the time spent arranging is counted (CoServe Fig. 15)


def test_arrival_order_outside_the_window():
    requests = [make_request(f"{a}{i}", a) for i in range(3) for a in "AB"]  # A0 B0 A1 B1 A2 B2
    sched = make_scheduler(*requests, window=3)
    assert scheduled_ids(sched) == ["A0", "A1", "B0", "B1", "A2", "B2"]  # window A0 B0 A1, then arrival order
    sched = make_scheduler(*(make_request(f"{a}{i}", a) for i in range(3) for a in "AB"), window=3, max_num_seqs=4)
    assert scheduled_ids(sched) == ["A0", "A1", "B0", "B1"] and waiting_ids(sched) == ["A2", "B2"]


def test_the_oldest_request_goes_first_and_none_starves():
    # B0 is alone in its group and A requests keep arriving: B0 still starts right after A0,
    # and every request starts within (ready requests ahead of it) + 1 steps.
    sched = make_scheduler(make_request("B0", "B"), *(make_request(f"A{i}", "A") for i in range(5)),
                           window=4, max_num_seqs=1)
    assert scheduled_ids(sched) == ["B0"]
    initial = [make_request("A0", "A"), make_request("B0", "B"), make_request("C0", "C"), make_request("A1", "A"),
               make_request("B1", "B"), make_request("base0")]
    sched = make_scheduler(*initial, window=4, max_num_seqs=1)
    started: dict[str, int] = {}
    for step in range(1, 20):
        finish_running(sched)
        sched.add(make_request(f"new{step}", "A"))
        (started_now,) = scheduled_ids(sched)
        started[started_now] = step
    for position, r in enumerate(initial):
        assert started[r.request_id] <= position + 1, (r.request_id, started)
    assert [r.request_id for r in sorted(initial, key=lambda r: started[r.request_id])] == [
        "A0", "B0", "C0", "A1", "B1", "base0"]  # with one start per step: arrival order again


def test_requests_waiting_for_their_adapter_are_passed_over_and_keep_their_place():
    x0, x1 = make_request("X0", "X", ready=False), make_request("X1", "X", ready=False)
    sched = make_scheduler(x0, make_request("A0", "A"), x1, make_request("base0"), make_request("A1", "A"),
                           window=3)
    assert scheduled_ids(sched) == ["A0", "base0", "A1"]
    assert waiting_ids(sched) == ["X0", "X1"] and x0.status is RequestStatus.WAITING
    sched.add(make_request("A2", "A"))
    x0.binding.resident(1)  # swapped in
    x1.binding.resident(1)
    assert scheduled_ids(sched)[-3:] == ["X0", "X1", "A2"]


def test_a_full_kv_pool_stops_admission_for_every_group():
    big = make_request("A0", "A", num_prompt=40)  # needs 10 blocks, the pool has 8
    sched = make_scheduler(big, make_request("B0", "B"), make_request("A1", "A"), num_blocks=8)
    assert scheduled_ids(sched) == [] and waiting_ids(sched) == ["A0", "B0", "A1"]


def test_without_lora_admission_is_arrival_order():
    requests = [make_request("base0"), make_request("e0", "esft", esft=True), make_request("base1"),
                make_request("e1", "esft", esft=True), make_request("base2")]
    sched = make_scheduler(*requests, window=4, max_num_seqs=3)
    assert scheduled_ids(sched) == ["base0", "e0", "base1"]
    assert waiting_ids(sched) == ["e1", "base2"]


def test_ready_requests_start_behind_any_number_of_swap_waiters():
    """However long the queue of requests waiting for their adapters' swaps, the requests of
    resident adapters (and of the base model) behind it start in the next step, and the waiters
    keep their order (a bound of 64 looked-past requests once left them queued)."""
    waiters = [make_request(f"x{i}", f"X{i % 7}", ready=False) for i in range(300)]
    sched = make_scheduler(*waiters, make_request("a0", "A"), make_request("base0"),
                           make_request("x300", "X0", ready=False), num_blocks=1024)
    assert scheduled_ids(sched) == ["a0", "base0"]
    assert waiting_ids(sched) == [f"x{i}" for i in range(301)]


def test_window_requests_and_config():
    sched = make_scheduler(*(make_request(str(i), "A") for i in range(5)), window=3)
    assert [r.request_id for r in sched.window_requests()] == ["0", "1", "2"]
    assert EngineConfig(model="m").scheduling_window == 16
    with pytest.raises(ValueError, match="scheduling_window"):
        EngineConfig(model="m", scheduling_window=0)
    with pytest.raises(ValueError, match="scheduling_window"):
        Scheduler(BlockManager(4, 4), 8, 8, window=0)


def test_fcfs_arranging_admits_the_window_in_arrival_order():
    """The Samba-CoE baseline (`request_arranging="fcfs"`): no grouping, the oldest first."""
    requests = [make_request(f"{a}{i}", a) for i in range(3) for a in "AB"]  # A0 B0 A1 B1 A2 B2
    sched = make_scheduler(*requests, max_num_seqs=4, arranging="fcfs")
    assert scheduled_ids(sched) == ["A0", "B0", "A1", "B1"] and waiting_ids(sched) == ["A2", "B2"]
    sched = make_scheduler(make_request("X0", "X", ready=False), make_request("A0", "A"), make_request("B0", "B"),
                           make_request("A1", "A"), window=4, arranging="fcfs")
    assert scheduled_ids(sched) == ["A0", "B0", "A1"] and waiting_ids(sched) == ["X0"]  # still passed over
    assert EngineConfig(model="m").request_arranging == "coserve"
    with pytest.raises(ValueError, match="request_arranging"):
        EngineConfig(model="m", request_arranging="sjf")
    with pytest.raises(ValueError, match="request_arranging"):
        Scheduler(BlockManager(4, 4), 8, 8, arranging="sjf")
