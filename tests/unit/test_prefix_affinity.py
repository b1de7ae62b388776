"""The router's memory of which rank holds which prompt prefix (`coordinator.prefix_affinity`), and
the router choosing by it."""

from __future__ import annotations

import asyncio

from coordinator.prefix_affinity import PrefixAffinity
from coordinator.router import Router
from elasticmoe.engine.prefix_hash import ROOT, block_hash
from tests.unit.test_coordinator_router import serving

SYSTEM = list(range(100, 132))  # two blocks of 16


def test_names_are_the_engines_block_names_up_to_the_last_tokens_block():
    affinity = PrefixAffinity(2)
    names = affinity.names(SYSTEM + [1, 2], None)
    assert names == [block_hash(ROOT, b"", SYSTEM[:16]), block_hash(names[0], b"", SYSTEM[16:])]
    assert len(affinity.names(SYSTEM, None)) == 1  # 32 tokens: the second block holds the last one
    assert affinity.names(SYSTEM + [1], "tone") != affinity.names(SYSTEM + [1], None)  # adapters apart
    assert affinity.names(SYSTEM + [1], None, "tenant") != affinity.names(SYSTEM + [1], None)  # salts apart
    assert len(PrefixAffinity(1, max_depth=1).names(SYSTEM * 4, None)) == 1


def test_the_rank_holding_the_longest_prefix_wins_within_the_slack():
    affinity = PrefixAffinity(3, slack=2)
    names = affinity.names(SYSTEM + [1, 2], None)
    assert affinity.choose(names, [0, 0, 0], default=0) == 0  # nothing known: the assignment's choice
    affinity.record(2, names[:1])
    affinity.record(1, names)
    assert [affinity.depth(r, names) for r in range(3)] == [0, 2, 1]
    assert affinity.choose(names, [0, 2, 0], default=0) == 1  # 2 more in flight: within the slack
    assert affinity.choose(names, [0, 3, 0], default=0) == 2  # 3 more: too busy; rank 2 holds a part
    assert affinity.choose(names, [0, 3, 3], default=0) == 0  # none near the least load holds any
    assert affinity.choose([], [0, 0, 0], default=2) == 2


def test_each_rank_remembers_a_bounded_number_of_names_oldest_out_first():
    affinity = PrefixAffinity(1, max_names=2)
    a, b, c = (affinity.names([i] * 17, None) for i in (1, 2, 3))
    affinity.record(0, a)
    affinity.record(0, b)
    affinity.record(0, a)  # used again: the newest
    affinity.record(0, c)
    assert [affinity.depth(0, n) for n in (a, b, c)] == [1, 0, 1]


def test_the_router_sends_a_prefix_back_where_it_went_and_forgets_on_a_new_instance():
    async def main():
        router: Router[str] = Router(prefix_affinity=True)
        router.update(serving("r0", "r1"))
        async with router.route(None, SYSTEM + [1]) as first:
            async with router.route(None, SYSTEM + [2]) as second:  # r1 is free, but r0 holds the prefix
                assert first.rank == second.rank == "r0"
            async with router.route(None, list(range(500, 540))) as other:  # nothing shared: least loaded
                assert other.rank == "r1"
        async with router.route(None, SYSTEM + [3]) as again:
            assert again.rank == "r0"
        router.update(serving("r2", "r3"))  # another instance: its caches are empty
        async with router.route(None, list(range(600, 640))) as busy, router.route(None, SYSTEM + [4]) as new:
            assert (busy.rank, new.rank) == ("r2", "r3")

        plain: Router[str] = Router()  # affinity off: least loaded, ties to the lowest rank
        plain.update(serving("r0", "r1"))
        async with plain.route(None, SYSTEM + [1]) as first, plain.route(None, SYSTEM + [2]) as second:
            assert (first.rank, second.rank) == ("r0", "r1")

    asyncio.run(main())
