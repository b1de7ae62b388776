"""Automatic prefix caching in the block manager and the scheduler: which blocks a request takes
over, which it computes, and which the pool gives up first."""

from __future__ import annotations

import pytest

from elasticmoe.engine.block_manager import BlockManager
from elasticmoe.engine.prefix_hash import ROOT, block_hash, extend_block_hashes
from elasticmoe.engine.request import AdapterBinding, Request, RequestStatus
from elasticmoe.engine.scheduler import Scheduler
from elasticmoe.sampling_params import SamplingParams

BS = 4


def make_request(request_id: str, tokens: list[int], salt: bytes | None = b"") -> Request:
    request = Request(request_id, list(tokens), len(tokens), SamplingParams(), 10_000)
    request.binding = AdapterBinding(cache_salt=salt)
    return request


def compute(bm: BlockManager, request: Request) -> None:
    """What a step that computes the rest of the request's tokens leaves behind."""
    assert bm.allocate_slots(request, request.num_tokens - request.num_computed_tokens)
    request.num_computed_tokens = request.num_tokens
    bm.cache_full_blocks(request)


def serve_and_free(bm: BlockManager, request: Request) -> list[int]:
    bm.match_prefix(request)
    bm.count_lookup(request)  # as the scheduler does when the request starts
    compute(bm, request)
    blocks = list(request.block_ids)
    bm.free(request)
    return blocks


def test_block_names_chain_over_every_earlier_token_and_the_salt():
    hashes: list[bytes] = []
    extend_block_hashes(hashes, list(range(10)), 10, BS, b"")
    assert len(hashes) == 2  # two full blocks of 4; the last 2 tokens fill none
    assert hashes[0] == block_hash(ROOT, b"", [0, 1, 2, 3])
    assert hashes[1] == block_hash(hashes[0], b"", [4, 5, 6, 7])
    other: list[bytes] = []
    extend_block_hashes(other, [9, 1, 2, 3, 4, 5, 6, 7], 8, BS, b"")
    assert other[0] != hashes[0] and other[1] != hashes[1]  # same block tokens, another prefix
    salted: list[bytes] = []
    extend_block_hashes(salted, list(range(8)), 8, BS, b"0:adapter")
    assert salted[0] != hashes[0]
    extend_block_hashes(hashes, list(range(12)), 12, BS, b"")  # extends, keeps what it had
    assert len(hashes) == 3 and hashes[1] == block_hash(hashes[0], b"", [4, 5, 6, 7])


def test_a_second_request_takes_the_full_blocks_of_a_shared_prefix():
    bm = BlockManager(16, BS, prefix_caching=True)
    first = make_request("first", list(range(10)))
    blocks = serve_and_free(bm, first)
    assert bm.num_cached_blocks == 2 and bm.num_free_blocks == 16  # cached blocks are free
    second = make_request("second", list(range(9)) + [42, 43])
    assert bm.match_prefix(second) == 8
    assert second.block_ids == blocks[:2] and second.num_computed_tokens == 8
    bm.count_lookup(second)
    assert bm.prefix_queries == 10 + 11 and bm.prefix_hits == 8
    bm.check_integrity([second])
    compute(bm, second)  # writes only past the shared blocks
    assert second.block_ids[:2] == blocks[:2] and second.block_ids[2] not in blocks[:2]
    bm.check_integrity([second])


def test_the_last_token_is_always_computed():
    bm = BlockManager(16, BS, prefix_caching=True)
    serve_and_free(bm, make_request("a", list(range(8))))
    again = make_request("b", list(range(8)))  # the same 8 tokens: 2 full blocks cached
    assert bm.match_prefix(again) == 4  # the 2nd block holds the last token, whose logits are needed
    longer = make_request("c", list(range(9)))
    assert bm.match_prefix(longer) == 8


def test_a_request_does_not_share_blocks_across_salts_or_with_salt_none():
    bm = BlockManager(16, BS, prefix_caching=True)
    serve_and_free(bm, make_request("base", list(range(9))))
    assert bm.match_prefix(make_request("lora", list(range(9)), salt=b"0:x")) == 0
    per_token = make_request("routed", list(range(9)), salt=None)
    assert bm.match_prefix(per_token) == 0
    compute(bm, per_token)
    assert bm.num_cached_blocks == 2  # nothing of the per-token request is named
    assert bm.match_prefix(make_request("base2", list(range(9)))) == 8


def test_a_pool_without_prefix_caching_names_nothing():
    bm = BlockManager(16, BS)
    serve_and_free(bm, make_request("a", list(range(9))))
    assert bm.num_cached_blocks == 0 and bm.match_prefix(make_request("b", list(range(9)))) == 0


def test_unnamed_free_blocks_go_first_then_the_cached_block_freed_longest_ago():
    bm = BlockManager(4, BS, prefix_caching=True)
    old = serve_and_free(bm, make_request("old", [1, 1, 1, 1, 9]))  # its 1st block named, its 2nd not
    new = serve_and_free(bm, make_request("new", [2, 2, 2, 2, 9]))
    assert new[0] == old[1]  # the unnamed block freed last goes out first (the stack, as without caching)
    assert bm.num_cached_blocks == 2 and bm.num_free_blocks == 4
    taker = make_request("taker", [3] * 8)
    assert bm.allocate_slots(taker, 8)
    assert not set(taker.block_ids) & {old[0], new[0]}  # the unnamed free blocks go before any cached one
    assert bm.num_cached_blocks == 2
    more = make_request("more", [4] * 4)
    assert bm.allocate_slots(more, 4)
    assert more.block_ids == [old[0]] and bm.num_cached_blocks == 1  # the older cached block leaves
    assert bm.match_prefix(make_request("old-again", [1, 1, 1, 1, 9])) == 0
    hit = make_request("new-again", [2, 2, 2, 2, 9])
    assert bm.match_prefix(hit) == 4
    bm.check_integrity([taker, more, hit])


def test_a_cached_block_taken_again_is_no_longer_free():
    bm = BlockManager(4, BS, prefix_caching=True)
    serve_and_free(bm, make_request("a", list(range(9))))
    b = make_request("b", list(range(9)))
    bm.match_prefix(b)
    assert bm.num_free_blocks == 2  # the two matched blocks are held
    c = make_request("c", list(range(9)))
    bm.match_prefix(c)
    assert c.block_ids == b.block_ids and bm.ref_counts[b.block_ids[0]] == 2
    bm.check_integrity([b, c])
    bm.free(b)
    bm.free(c)
    assert bm.num_free_blocks == 4
    bm.check_integrity([])


def test_two_requests_computing_one_prefix_in_a_step_name_it_once():
    bm = BlockManager(8, BS, prefix_caching=True)
    a, b = make_request("a", list(range(5))), make_request("b", list(range(5)))
    for r in (a, b):
        assert bm.allocate_slots(r, 5)
    for r in (a, b):
        r.num_computed_tokens = 5
        bm.cache_full_blocks(r)
    assert bm.num_cached_blocks == 1
    bm.free(a)
    bm.free(b)
    bm.check_integrity([])
    c = make_request("c", list(range(5)))
    assert bm.match_prefix(c) == 4


def test_forget_cached_drops_every_name_and_frees_the_blocks():
    bm = BlockManager(8, BS, prefix_caching=True)
    serve_and_free(bm, make_request("a", list(range(9))))
    held = make_request("held", list(range(20, 29)))
    compute(bm, held)
    bm.forget_cached()
    assert bm.num_cached_blocks == 0 and bm.num_free_blocks == 8 - len(held.block_ids)
    assert bm.match_prefix(make_request("b", list(range(9)))) == 0
    bm.check_integrity([held])
    bm.free(held)
    bm.check_integrity([])


def test_claimed_tables_share_blocks_once_each_and_refuse_blocks_in_use():
    bm = BlockManager(8, BS, prefix_caching=True)
    bm.claim_tables([[0, 1, 2], [0, 1, 3]])  # two handed-over requests of one prefix
    assert bm.ref_counts[:4] == [2, 2, 1, 1] and bm.num_free_blocks == 4
    with pytest.raises(ValueError, match="free"):
        bm.claim([3])
    with pytest.raises(ValueError, match="twice"):
        bm.claim_tables([[5, 5]])
    with pytest.raises(ValueError, match="free"):
        bm.claim([8])
    assert bm.num_free_blocks == 4  # the refused claims took nothing
    bm.release([0, 1, 2])
    bm.release([0, 1, 3])
    bm.check_integrity([])


def test_claiming_a_cached_free_block_drops_its_name():
    bm = BlockManager(4, BS, prefix_caching=True)
    blocks = serve_and_free(bm, make_request("a", list(range(5))))
    bm.claim([blocks[0]])  # e.g. a handed-over table: its holder writes it
    assert bm.num_cached_blocks == 0
    assert bm.match_prefix(make_request("b", list(range(5)))) == 0
    bm.release([blocks[0]])
    bm.check_integrity([])


def test_the_scheduler_starts_a_request_past_its_cached_prefix_and_budgets_only_the_rest():
    bm = BlockManager(16, BS, prefix_caching=True)
    sched = Scheduler(bm, max_num_batched_tokens=100, max_num_seqs=8)
    serve_and_free(bm, make_request("warm", list(range(13))))
    r = make_request("r", list(range(13)) + [7])
    sched.add(r)
    out = sched.schedule()
    assert [(x.request_id, n) for x, n in out.scheduled] == [("r", 2)]  # 12 of 14 tokens cached
    assert r.num_computed_tokens == 12 and r.status is RequestStatus.RUNNING
    bm.check_integrity([r])


def test_a_request_that_does_not_fit_gives_its_matched_blocks_back():
    bm = BlockManager(4, BS, prefix_caching=True)
    sched = Scheduler(bm, max_num_batched_tokens=100, max_num_seqs=8)
    serve_and_free(bm, make_request("warm", list(range(9))))  # 2 cached blocks
    hog = make_request("hog", [5] * 8)
    assert bm.allocate_slots(hog, 8)  # the two unnamed blocks
    big = make_request("big", list(range(9)) + [1] * 4)  # 8 cached tokens + 5 more: 2 more blocks, none free
    sched.add(big)
    assert sched.schedule().is_empty
    assert big.block_ids == [] and big.num_computed_tokens == 0 and big.status is RequestStatus.WAITING
    assert bm.num_cached_blocks == 2 and bm.num_free_blocks == 2
    queries = bm.prefix_queries
    assert sched.schedule().is_empty
    assert bm.prefix_queries == queries  # a request that does not start is not counted at each try
    bm.free(hog)
    assert [(r.request_id, n) for r, n in sched.schedule().scheduled] == [("big", 5)]
    assert bm.prefix_queries == queries + 13 and bm.prefix_hits == 8 and big.num_cached_tokens == 8
    bm.check_integrity([hog, big])


def test_a_preempted_request_finds_its_own_blocks_again():
    bm = BlockManager(6, BS, prefix_caching=True)
    sched = Scheduler(bm, max_num_batched_tokens=64, max_num_seqs=8)
    a, b = make_request("a", list(range(12))), make_request("b", list(range(100, 112)))
    sched.add(a)
    sched.add(b)
    out = sched.schedule()
    for request, n in out.scheduled:
        request.num_computed_tokens += n
        bm.cache_full_blocks(request)
        request.token_ids.append(1)
    out = sched.schedule()  # both need a 4th block, 6 in the pool: b is preempted
    assert out.preempted_ids == ["b"]
    for request, n in out.scheduled:
        request.num_computed_tokens += n
    sched.finish(a)  # a leaves: room for b again
    out = sched.schedule()
    # a's 4th block was b's last one (a table is freed tail first, so its tail is evicted first):
    # b finds its first 8 tokens and computes 5
    assert [(x.request_id, n) for x, n in out.scheduled] == [("b", 5)]
    assert b.num_computed_tokens == 8
    bm.check_integrity([b])


def test_a_request_whose_prefix_is_being_computed_starts_one_step_later_past_it():
    """`n` choices or a burst of one system prompt: the first request computes the prefix, the others
    take it from the cache a step later instead of computing it beside it."""
    bm = BlockManager(32, BS, prefix_caching=True)
    sched = Scheduler(bm, max_num_batched_tokens=100, max_num_seqs=8)
    first, same, other = (make_request("first", list(range(13))), make_request("same", list(range(13))),
                          make_request("other", list(range(50, 63))))
    for r in (first, same, other):
        sched.add(r)
    out = sched.schedule()
    assert [(r.request_id, n) for r, n in out.scheduled] == [("first", 13), ("other", 13)]
    assert same.status is RequestStatus.WAITING and same.block_ids == [] and sched.waiting[0] is same
    for request, n in out.scheduled:
        request.num_computed_tokens += n
        bm.cache_full_blocks(request)
        request.token_ids.append(1)
    out = sched.schedule()
    assert sorted((r.request_id, n) for r, n in out.scheduled) == [("first", 1), ("other", 1), ("same", 1)]
    assert same.num_cached_tokens == 12 and same.block_ids[:3] == first.block_ids[:3]
    bm.check_integrity([first, same, other])


def test_a_small_shared_part_is_not_worth_a_step_of_waiting():
    bm = BlockManager(32, BS, prefix_caching=True)
    sched = Scheduler(bm, max_num_batched_tokens=100, max_num_seqs=8)
    a = make_request("a", list(range(20)))
    b = make_request("b", list(range(8)) + list(range(100, 120)))  # 8 of its 28 tokens in flight
    sched.add(a)
    sched.add(b)
    assert sorted((r.request_id, n) for r, n in sched.schedule().scheduled) == [("a", 20), ("b", 28)]


def test_a_request_follows_a_long_prefill_chunk_by_chunk():
    bm = BlockManager(32, BS, prefix_caching=True)
    sched = Scheduler(bm, max_num_batched_tokens=16, max_num_seqs=8)
    long_prompt = list(range(3, 40))  # 37 tokens: chunks of 16, 16, 5
    a, b = make_request("a", long_prompt), make_request("b", long_prompt + [99])
    sched.add(a)
    sched.add(b)
    # b waits while a's chunks compute what it would compute, even a's last block
    for expected in ([("a", 16)], [("a", 16)], [("a", 5)], [("a", 1), ("b", 2)]):
        out = sched.schedule()
        assert sorted((r.request_id, n) for r, n in out.scheduled) == expected
        for request, n in out.scheduled:
            request.num_computed_tokens += n
            bm.cache_full_blocks(request)
            if request.num_computed_tokens == request.num_tokens:
                request.token_ids.append(1)
    assert b.num_cached_tokens == 36  # every block of a's prompt
    bm.check_integrity([a, b])
