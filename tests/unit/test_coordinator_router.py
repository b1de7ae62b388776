"""The ingress's router over published `RoutingState`s, the coordinator's `RoutingFeed` (long
polls woken from other threads) and the follower between them (a coordinator that cannot be
reached holds requests and says so; the next state it publishes is taken at once)."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import threading

import pytest

from coordinator.active import ActiveInstance
from coordinator.router import NoActiveInstance, Router
from coordinator.routing_follower import COORDINATOR, RoutingFollower
from coordinator.routing_state import RoutingFeed, RoutingState

_versions = iter(range(1, 10_000))


def serving(*ranks: str, accepting: bool = True, max_model_len: int = 64, adapters: tuple[str, ...] = (),
            epoch: str = "e0") -> RoutingState:
    """A published state with these ranks (the router sees nothing else of an instance)."""
    return RoutingState(epoch, next(_versions), "inst", ranks, max_model_len, adapters, is_accepting=accepting,
                        is_serving=bool(ranks))


def run(coro):
    return asyncio.run(coro)


def test_least_loaded_rank_and_release():
    async def main():
        router: Router[str] = Router()
        router.update(serving("r0", "r1"))
        async with router.route() as a, router.route() as b:
            assert {a.rank, b.rank} == {"r0", "r1"}
            assert router.loads() == [1, 1]
            async with router.route() as c:
                assert c.rank == "r0" and c.key == router.state.key  # ties go to the lowest rank
                assert router.loads() == [2, 1]
        assert router.loads() == [0, 0]
        assert router.assign_s > 0  # the time spent choosing ranks (CoServe Fig. 15)

    run(main())


def test_no_instance_is_an_error():
    async def main():
        router: Router[str] = Router(max_hold_s=0.05)
        with pytest.raises(NoActiveInstance):  # nothing published yet: held, then refused
            async with router.route():
                pass
        router.update(serving())  # accepting, but no ranks (shut down)
        with pytest.raises(NoActiveInstance):
            async with router.route():
                pass

    run(main())


def test_held_requests_go_to_the_new_instance():
    async def main():
        router: Router[str] = Router(max_hold_s=5)
        router.update(serving("old0", accepting=False))  # a switchover's critical section
        chosen = []
        release = asyncio.Event()

        async def request():
            async with router.route() as route:
                chosen.append(route.rank)
                await release.wait()

        tasks = [asyncio.create_task(request()) for _ in range(3)]
        await asyncio.sleep(0.05)
        assert chosen == [] and router.num_held == 3  # held, not failed
        router.update(serving("new0", "new1"))
        await asyncio.sleep(0.05)
        assert sorted(chosen) == ["new0", "new0", "new1"] and router.loads() == [2, 1]
        release.set()
        await asyncio.gather(*tasks)
        assert router.num_held == 0 and router.loads() == [0, 0]

    run(main())


def test_held_too_long_fails_cleanly():
    async def main():
        router: Router[str] = Router(max_hold_s=0.05)
        router.update(serving("r0", accepting=False))
        with pytest.raises(NoActiveInstance):
            async with router.route():
                pass
        assert router.num_held == 0 and router.loads() == [0]

    run(main())


def test_requests_of_a_retired_instance_finish_on_its_counters():
    async def main():
        router: Router[str] = Router()
        router.update(serving("old"))
        async with router.route() as route:
            router.update(serving("new"))  # switch while a request is in flight on the old instance
            assert route.rank == "old"
            assert router.loads() == [0]
        assert router.loads() == [0]

    run(main())


def test_waiting_for_a_newer_state_or_a_replaced_rank():
    async def main():
        router: Router[str] = Router()
        first = serving("r0")
        router.update(first)
        assert not await router.wait_newer(first.key, 0.02)
        assert not await router.wait_replaced("r0", 0.02)
        later = asyncio.get_running_loop().call_later
        later(0.02, router.update, dataclasses.replace(first, version=first.version + 1))  # same ranks (a rollback)
        assert await router.wait_newer(first.key, 5)
        later(0.02, router.update, serving("n0"))
        assert await router.wait_replaced("r0", 5)

    run(main())


def test_the_published_state_is_the_only_source_of_limits_and_adapters():
    from coordinator.engine_client import RouterEngineClient

    async def main():
        router: Router[str] = Router()
        client = RouterEngineClient(router, tokenizer=None, max_queued=4)
        assert (client.max_model_len, client.adapter_names()) == (0, ())
        first = serving("r0", "r1", max_model_len=128)
        router.update(first)
        assert (client.max_model_len, client.adapter_names()) == (128, ())
        async with router.route():
            router.update(dataclasses.replace(first, version=first.version + 1, adapters=("law",)))  # same ranks
            assert router.loads() == [1, 0]  # in-flight counts kept
        assert client.adapter_names() == ("law",) and client.max_model_len == 128
        router.update(serving("n0", max_model_len=96))  # a new instance
        assert (client.max_model_len, router.loads()) == (96, [0])
        with pytest.raises(ValueError):
            ActiveInstance(None, (), (), max_model_len=96)

    run(main())


def test_feed_long_polls_wake_on_updates_from_other_threads():
    async def main():
        feed = RoutingFeed(epoch="e1")
        first = await feed.next(None, 0.0)  # at once: nothing to wait for
        assert first.key == ("e1", 0)
        assert (await feed.next(first.key, 0.05)).key == first.key  # a heartbeat after the timeout
        threading.Timer(0.05, lambda: feed.update(ranks=("r0",), is_accepting=True)).start()
        t0 = asyncio.get_running_loop().time()
        second = await feed.next(first.key, 10)
        assert second.version == 1 and second.ranks == ("r0",) and second.is_accepting
        assert asyncio.get_running_loop().time() - t0 < 5  # woken, not timed out
        assert feed.current is second

    run(main())


def test_follower_holds_requests_while_the_coordinator_is_unreachable():
    async def main():
        feed = RoutingFeed(epoch="e1")
        feed.update(ranks=("r0",), is_accepting=True, is_serving=True)
        reachable = asyncio.Event()
        reachable.set()

        async def fetch(after, timeout_s):
            if not reachable.is_set():
                raise ConnectionError("coordinator gone")
            return await feed.next(after, timeout_s)

        router: Router[str] = Router()
        follower = RoutingFollower(fetch, router, poll_timeout_s=0.05, retry_s=0.01)
        follower.start()
        await follower.wait_serving(5)
        assert router.is_accepting and follower.is_connected
        reachable.clear()
        await asyncio.sleep(0.2)  # the next poll fails
        state = router.state
        assert not follower.is_connected and not router.is_accepting and not state.is_serving
        assert state.ranks == ("r0",) and COORDINATOR in state.fault_dict()  # ranks kept, fault said
        # A restarted coordinator: a new epoch with new ranks, taken at once on reconnection.
        feed2 = RoutingFeed(epoch="e2")
        feed2.update(ranks=("n0",), is_accepting=True, is_serving=True)
        feed = feed2  # `fetch` reads the enclosing name
        reachable.set()
        for _ in range(100):
            if router.state.epoch == "e2":
                break
            await asyncio.sleep(0.02)
        assert router.state.ranks == ("n0",) and router.is_accepting and follower.is_connected
        await follower.stop()

    run(main())


def test_coserve_assignment_groups_an_adapter_and_balances_the_latency_model():
    from elasticmoe.adapter_policy.profile import KindProfile

    async def main(assign: str) -> list[str]:
        # A batch of one adapter costs B once and K per request (K=0.1, B=1): a further request of
        # an adapter already queued on a rank adds only K there, a first one B + K anywhere.
        kind = KindProfile(max_batch=8, k_s=0.1, b_s=1.0)
        router: Router[str] = Router(assign=assign, kinds={"lora": kind, "base": kind})
        router.update(dataclasses.replace(serving("r0", "r1", adapters=("law", "med")),
                                          adapter_kinds=(("law", "lora"), ("med", "lora"))))
        chosen: list[str] = []
        async with contextlib.AsyncExitStack() as stack:
            for adapter in ("law", "med", "law", "law"):
                chosen.append((await stack.enter_async_context(router.route(adapter))).rank)
        assert router.loads() == [0, 0]
        return chosen

    # coserve keeps law's three requests in one batch on r0 (queues 1.3 s and 1.1 s); parallel
    # balances counts and splits law over both ranks (two batches of it: 1.2 s and 2.2 s).
    assert run(main("coserve")) == ["r0", "r1", "r0", "r0"]
    assert run(main("parallel")) == ["r0", "r1", "r0", "r1"]
    with pytest.raises(ValueError, match="request_assigning"):
        Router(assign="magic")


def test_ranks_with_their_own_lora_slots_keep_an_adapter_where_it_was_sent():
    """Ranks that swap their own LoRA slots (`lora_slots_per_rank`) hold different adapters: CoServe's
    assignment sends a request where its adapter went before (no switch) while that rank's queue is
    at most one request longer than the other's, else to the shorter queue; the least-loaded
    baseline alternates."""

    async def main(assign: str) -> list[str]:
        router: Router[str] = Router(assign=assign, lora_slots_per_rank=2)
        names = ("law", "med", "code")
        router.update(dataclasses.replace(serving("r0", "r1", adapters=(*names, "esft0")),
                                          adapter_kinds=(*((n, "lora") for n in names), ("esft0", "esft"))))
        chosen: list[str] = []
        async with contextlib.AsyncExitStack() as stack:
            for adapter in ("law", "med", "law", "med", "law", "law", "law", None, "code", "esft0"):
                chosen.append((await stack.enter_async_context(router.route(adapter))).rank)
        assert router.loads() == [0, 0]
        async with router.route("med") as again:  # idle ranks: med goes back to the rank holding it
            chosen.append(again.rank)
        return chosen

    # law stays on r0 and med on r1; the fifth law finds r0 two requests ahead and goes to r1 (which
    # swaps it in); the base model and the ESFT adapter (the instance's) only balance.
    assert run(main("coserve")) == ["r0", "r1", "r0", "r1", "r0", "r0", "r1", "r1", "r0", "r1", "r1"]
    assert run(main("parallel")) == ["r0", "r1", "r0", "r1", "r0", "r1", "r0", "r1", "r0", "r1", "r0"]


def test_lora_slots_per_rank_estimate_is_the_last_adapters_sent():
    from coordinator.lora_residency import RecentLora

    recent = RecentLora(num_ranks=2, slots=2)
    for adapter in ("a", "b", "a", "c"):  # rank 0 holds the two sent last: a, c (b was swapped out)
        recent.record(0, adapter)
    kinds = {"a": "lora", "b": "lora", "c": "lora", "e": "esft"}
    view = recent.view(0, frozenset({"a", "b", "c", "e"}), kinds)
    assert "a" in view and "c" in view and "b" not in view
    assert "e" in view  # other kinds: what the instance holds
    assert "a" not in recent.view(1, frozenset({"a", "e"}), kinds)
    assert "c" not in recent.view(0, frozenset({"a", "e"}), kinds)  # no longer accepted
    with pytest.raises(ValueError):
        RecentLora(num_ranks=2, slots=0)
