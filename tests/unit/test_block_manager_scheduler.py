from __future__ import annotations

from elasticmoe.engine.block_manager import BlockManager
from elasticmoe.engine.request import Request, RequestStatus
from elasticmoe.engine.scheduler import Scheduler
from elasticmoe.sampling_params import SamplingParams


def make_request(request_id: str, num_prompt: int, max_total: int = 10_000) -> Request:
    return Request(request_id, list(range(num_prompt)), num_prompt, SamplingParams(), max_total)


def complete_step(sched_out) -> None:
    """What the engine does after a forward: mark tokens computed, append a token when at the end."""
    for request, n in sched_out.scheduled:
        request.num_computed_tokens += n
        if request.num_computed_tokens == request.num_tokens:
            request.token_ids.append(1)


def test_the_blocks_freed_last_are_handed_out_first():
    # A pool's pages take memory on first touch: one request after another must reuse the same
    # blocks, not walk through the whole pool (the server's memory grew with every request).
    bm = BlockManager(num_blocks=64, block_size=4)
    first = make_request("first", 8)
    assert bm.allocate_slots(first, 8) and first.block_ids == [0, 1]  # a fresh pool: from block 0
    touched = set(first.block_ids)
    bm.free(first)
    for i in range(100):
        r = make_request(f"r{i}", 5 + i % 4)
        assert bm.allocate_slots(r, r.num_tokens)
        touched.update(r.block_ids)
        bm.free(r)
    assert touched == {0, 1}
    bm.check_integrity([])


def test_block_manager_allocates_and_frees_exactly():
    bm = BlockManager(num_blocks=4, block_size=4)
    r = make_request("a", 5)
    assert bm.num_blocks_needed(r, 5) == 2
    assert bm.allocate_slots(r, 5)
    assert len(r.block_ids) == 2 and bm.num_free_blocks == 2
    big = make_request("b", 13)
    assert not bm.allocate_slots(big, 13)  # needs 4, only 2 free: nothing changes
    assert big.block_ids == [] and bm.num_free_blocks == 2
    bm.check_integrity([r])
    bm.free(r)
    assert bm.num_free_blocks == 4 and r.block_ids == []
    bm.check_integrity([])


def test_chunked_prefill_respects_token_budget():
    sched = Scheduler(BlockManager(64, 4), max_num_batched_tokens=8, max_num_seqs=8)
    a, b = make_request("a", 10), make_request("b", 3)
    sched.add(a)
    sched.add(b)
    out = sched.schedule()
    assert [(r.request_id, n) for r, n in out.scheduled] == [("a", 8)]
    complete_step(out)
    out = sched.schedule()
    # a finishes its prompt (2 tokens), b starts; decodes are listed first.
    assert sorted((r.request_id, n) for r, n in out.scheduled) == [("a", 2), ("b", 3)]
    assert out.num_tokens <= 8
    complete_step(out)
    out = sched.schedule()
    assert [(r.request_id, n) for r, n in out.scheduled] == [("a", 1), ("b", 1)]


def test_preemption_frees_newest_and_requeues_it_first():
    bm = BlockManager(num_blocks=4, block_size=4)
    sched = Scheduler(bm, max_num_batched_tokens=64, max_num_seqs=8)
    a, b = make_request("a", 8), make_request("b", 8)
    sched.add(a)
    sched.add(b)
    complete_step(sched.schedule())  # both prompts fill all 4 blocks; each appended one token
    out = sched.schedule()  # both need a 3rd block: b (newest) is preempted for a
    assert out.preempted_ids == ["b"]
    assert [(r.request_id, n) for r, n in out.scheduled] == [("a", 1)]
    assert b.status == RequestStatus.WAITING and b.num_computed_tokens == 0 and b.block_ids == []
    assert sched.waiting[0] is b and b.num_tokens == 9  # its sampled token is kept for recompute
    bm.check_integrity([a, b])


def test_max_num_seqs_limits_admission():
    sched = Scheduler(BlockManager(64, 4), max_num_batched_tokens=1000, max_num_seqs=2)
    for i in range(3):
        sched.add(make_request(str(i), 2))
    assert len(sched.schedule().scheduled) == 2
    assert len(sched.waiting) == 1


def test_finish_removes_from_any_queue():
    bm = BlockManager(8, 4)
    sched = Scheduler(bm, 100, 8)
    a, b = make_request("a", 4), make_request("b", 4)
    sched.add(a)
    sched.schedule()
    sched.add(b)
    sched.finish(a)
    sched.finish(b)
    assert not sched.has_unfinished() and bm.num_free_blocks == 8
