from __future__ import annotations

import asyncio

import pytest

from coordinator.active import ActiveInstance
from coordinator.router import NoActiveInstance, Router


def serving(*ranks: str) -> ActiveInstance:
    """A snapshot of an instance with these ranks (the router sees nothing else of it)."""
    return ActiveInstance(None, ranks, (), max_model_len=64)

def run(coro):
    return asyncio.run(coro)


def test_least_loaded_rank_and_release():
    async def main():
        router: Router[str] = Router()
        router.set_active(serving("r0", "r1"))
        async with router.route() as a, router.route() as b:
            assert {a, b} == {"r0", "r1"}
            assert router.loads() == [1, 1]
            async with router.route() as c:
                assert c == "r0"  # ties go to the lowest rank
                assert router.loads() == [2, 1]
        assert router.loads() == [0, 0]

    run(main())


def test_no_active_instance_is_an_error():
    async def main():
        router: Router[str] = Router()
        with pytest.raises(NoActiveInstance):
            async with router.route():
                pass

    run(main())


def test_requests_wait_at_closed_gate_and_go_to_the_new_instance():
    async def main():
        router: Router[str] = Router(max_hold_s=5)
        router.set_active(serving("old0"))
        router.close_gate()
        chosen = []
        release = asyncio.Event()

        async def request():
            async with router.route() as rank:
                chosen.append(rank)
                await release.wait()

        tasks = [asyncio.create_task(request()) for _ in range(3)]
        await asyncio.sleep(0.05)
        assert chosen == [] and router.num_held == 3  # held, not failed
        router.set_active(serving("new0", "new1"))
        router.open_gate()
        await asyncio.sleep(0.05)
        assert sorted(chosen) == ["new0", "new0", "new1"] and router.loads() == [2, 1]
        release.set()
        await asyncio.gather(*tasks)
        assert router.num_held == 0 and router.loads() == [0, 0]

    run(main())


def test_gate_held_too_long_fails_cleanly():
    async def main():
        router: Router[str] = Router(max_hold_s=0.05)
        router.set_active(serving("r0"))
        router.close_gate()
        with pytest.raises(NoActiveInstance):
            async with router.route():
                pass
        assert router.num_held == 0 and router.loads() == [0]

    run(main())


def test_requests_of_a_retired_instance_finish_on_its_counters():
    async def main():
        router: Router[str] = Router()
        router.set_active(serving("old"))
        async with router.route() as rank:
            router.set_active(serving("new"))  # switch while a request is in flight on the old instance
            assert rank == "old"
            assert router.loads() == [0]
        assert router.loads() == [0]

    run(main())


def test_the_published_snapshot_is_the_only_source_of_limits_and_adapters():
    from coordinator.engine_client import RouterEngineClient

    async def main():
        router: Router[str] = Router()
        client = RouterEngineClient(router, tokenizer=None, max_queued=4)
        assert (client.max_model_len, client.adapter_names()) == (0, ())
        first = ActiveInstance(None, ("r0", "r1"), (0, 1), max_model_len=128)
        router.set_active(first)
        assert (client.max_model_len, client.adapter_names()) == (128, ())
        async with router.route():
            router.set_active(first.with_adapters(("law",)))  # an adapter loaded: same ranks
            assert router.loads() == [1, 0]  # in-flight counts kept
        assert client.adapter_names() == ("law",) and client.max_model_len == 128
        router.set_active(ActiveInstance(None, ("n0",), (2,), max_model_len=96))  # a new instance
        assert (client.max_model_len, router.loads()) == (96, [0])
        with pytest.raises(ValueError):
            ActiveInstance(None, (), (), max_model_len=96)

    run(main())
