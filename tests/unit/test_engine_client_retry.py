"""`RouterEngineClient.generate` routes a request again when its rank was retired before it ran
(Ray's ActorDiedError, seen under load at a scale's switchover) or was pausing (once the next
state is published); when its rank dies after it streamed, it continues on the replacement
from what the client has (never twice the same token), a bounded number of times; and the SLO
estimator hears about arrivals and failures. A rank's exported streams wait for their route
(`PendingRoutes`) and fail as a rank failure when none comes."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest
from ray.exceptions import ActorDiedError

import coordinator.engine_client as engine_client
from coordinator.engine_client import MAX_RECOVERIES, RouterEngineClient
from coordinator.router import Router
from coordinator.routing_state import RoutingState
from elasticmoe.engine.engine_request import AdapterRef, EngineRequest
from elasticmoe.entrypoints.openai.errors import OpenAIError
from elasticmoe.errors import UnknownAdapterError
from elasticmoe.outputs import OutputDelta, RequestOutput
from elasticmoe.sampling_params import SamplingParams

_versions = iter(range(1, 10_000))


def serving(*ranks: str) -> RoutingState:
    """A published state with these ranks (the router sees nothing else of an instance)."""
    return RoutingState("e0", next(_versions), "inst", ranks, 64, (), is_accepting=True, is_serving=True)


def _output(request_id: str, finished: bool) -> OutputDelta:
    return OutputDelta(request_id, [7], "x", finished=finished, finish_reason="length" if finished else None)


def _client(monkeypatch, script):
    """A client over ranks "old" and "new" whose streams follow `script(rank, attempt)`."""
    calls: list[str] = []

    async def fake_stream_from(rank, request, channels, progress):
        calls.append(rank)
        sent.append(request)
        async for delta in script(rank, len(calls), request.request_id):
            yield progress.add(delta)

    sent: list[EngineRequest] = []

    monkeypatch.setattr(engine_client, "_stream_from", fake_stream_from)
    router: Router[str] = Router()
    router.update(serving("old"))
    failed_ranks: list[str] = []
    client = RouterEngineClient(router, tokenizer=None, max_queued=4,
                                on_rank_failure=failed_ranks.append, recovery_wait_s=5)
    events: list[str] = []
    client.on_arrival, client.on_failed = (lambda: events.append("arrival")), (lambda: events.append("failed"))
    client.sent, client.failed_ranks = sent, failed_ranks  # type: ignore[attr-defined]
    return client, router, calls, events


async def _collect(client: RouterEngineClient) -> list[RequestOutput]:
    return [o async for o in client.generate(EngineRequest("r1", [1], SamplingParams(max_tokens=4)))]


def test_a_retired_rank_before_any_output_is_routed_again(monkeypatch):
    async def script(rank, attempt, request_id):
        if rank == "old":
            router.update(serving("new"))  # the switchover happened meanwhile
            raise ActorDiedError()
        yield _output(request_id, finished=True)

    client, router, calls, events = _client(monkeypatch, script)
    outs = asyncio.run(_collect(client))
    assert calls == ["old", "new"] and outs[-1].finished
    assert events == ["arrival"] and client.num_queued == 0


def test_a_rank_dying_after_output_continues_on_the_replacement(monkeypatch):
    async def script(rank, attempt, request_id):
        if rank == "old":
            yield _output(request_id, finished=False)
            asyncio.get_running_loop().call_later(0.05, router.update, serving("new"))  # the watcher replaces it
            raise ActorDiedError()
        yield _output(request_id, finished=True)

    client, router, calls, events = _client(monkeypatch, script)
    outs = asyncio.run(_collect(client))
    assert calls == ["old", "new"] and client.failed_ranks == ["old"]
    assert [o.new_token_ids for o in outs] == [[7], [7]] and outs[-1].finished
    first, resumed = client.sent
    assert first.resume is None
    assert resumed.resume is not None and resumed.resume.output_token_ids == (7,)  # what the client has
    assert resumed.resume.num_emitted_chars == 1 and resumed.prompt == [1]
    assert events == ["arrival"] and client.num_recovered == 1 and client.num_queued == 0


def test_a_request_that_kills_every_instance_gets_a_503(monkeypatch):
    async def script(rank, attempt, request_id):
        yield _output(request_id, finished=False)
        asyncio.get_running_loop().call_soon(router.update, serving(f"r{attempt}"))
        raise ActorDiedError()

    client, router, calls, events = _client(monkeypatch, script)
    with pytest.raises(OpenAIError) as info:
        asyncio.run(_collect(client))
    assert info.value.status_code == 503
    assert len(calls) == MAX_RECOVERIES + 1 and events == ["arrival", "failed"] and client.num_queued == 0


def test_a_failed_rank_that_is_never_replaced_is_a_503(monkeypatch):
    async def script(rank, attempt, request_id):
        yield _output(request_id, finished=False)
        raise ActorDiedError()

    client, router, calls, events = _client(monkeypatch, script)
    client.recovery_wait_s = 0.1
    with pytest.raises(OpenAIError) as info:
        asyncio.run(_collect(client))
    assert info.value.status_code == 503 and calls == ["old"]


def test_a_request_turned_away_by_a_pausing_rank_waits_for_the_next_state(monkeypatch):
    from imm.handover import RankPaused

    async def script(rank, attempt, request_id):
        if attempt == 1:
            asyncio.get_running_loop().call_later(0.05, router.update, serving("old"))  # a rollback: same ranks
            raise RankPaused(request_id)
        yield _output(request_id, finished=True)

    client, router, calls, events = _client(monkeypatch, script)
    outs = asyncio.run(_collect(client))
    assert calls == ["old", "old"] and outs[-1].finished and client.failed_ranks == []


def test_exported_streams_wait_for_their_route_or_fail_as_a_rank_failure():
    from imm.handover import HandoverAbandoned, PendingRoutes

    async def main():
        pending = PendingRoutes()
        pending.expect(["a", "b", "c"])
        waiting = asyncio.create_task(pending.next_rank("a", 30.0))
        await asyncio.sleep(0.01)
        assert pending.publish({"a": "new-rank", "elsewhere": "x"}) == 1  # others' routes are ignored
        assert await waiting == "new-rank"
        with pytest.raises(HandoverAbandoned):
            await pending.next_rank("b", 0.02)  # no route in time
        pending.abandon("the switchover failed")
        with pytest.raises(HandoverAbandoned) as info:
            await pending.next_rank("c", 30.0)
        assert isinstance(info.value, engine_client.EngineDeadError)  # the engine client resumes it elsewhere
        with pytest.raises(HandoverAbandoned):
            await pending.next_rank("never-exported", 30.0)

    asyncio.run(main())


def _with_adapter(state: RoutingState, swapped_out: tuple[str, ...]) -> RoutingState:
    return dataclasses.replace(state, version=next(_versions), adapters=("law",), swapped_out=swapped_out)


def _law(request_id: str = "r1") -> EngineRequest:
    return EngineRequest(request_id, [1], SamplingParams(max_tokens=4), AdapterRef("law"))


def test_requests_for_a_swapped_out_adapter_wait_for_one_swap_in(monkeypatch):
    """Three requests for an adapter on disk: one `make_resident` call, all three stream once
    the coordinator published it resident."""
    async def script(rank, attempt, request_id):
        yield _output(request_id, finished=True)

    client, router, calls, events = _client(monkeypatch, script)
    router.update(_with_adapter(serving("old"), ("law",)))
    swaps: list[str] = []

    async def make_resident(name):
        swaps.append(name)
        await asyncio.sleep(0.05)
        router.update(_with_adapter(serving("old"), ()))

    client.make_resident = make_resident
    used: list[str] = []
    client.on_adapter = used.append

    async def main():
        return await asyncio.gather(*[_drain(client.generate(_law(f"r{i}"))) for i in range(3)])

    outs = asyncio.run(main())
    assert swaps == ["law"] and all(o[-1].finished for o in outs) and calls == ["old"] * 3
    assert client.num_swap_waits == 3 and used == ["law"] * 3 and client.num_queued == 0


@pytest.mark.parametrize("refusals", [1, 30])
def test_a_request_refused_because_its_adapter_was_swapped_out_again_waits_and_is_sent_again(monkeypatch, refusals):
    """Refused by the rank (swapped out between the look at the state and the rank's admission),
    each time after the state listed the adapter swapped out and the swap brought it back: the
    request waits every time and then streams. Thirty (a slot contended by many adapters) do not
    fail it either: a registered adapter is never a 404."""
    async def script(rank, attempt, request_id):
        if attempt <= refusals:
            router.update(_with_adapter(serving("old"), ("law",)))
            raise UnknownAdapterError("law")
        yield _output(request_id, finished=True)

    client, router, calls, events = _client(monkeypatch, script)
    router.update(_with_adapter(serving("old"), ()))

    async def make_resident(name):
        router.update(_with_adapter(serving("old"), ()))

    client.make_resident = make_resident
    outs = asyncio.run(_drain(client.generate(_law())))
    assert outs[-1].finished and calls == ["old"] * (refusals + 1) and client.num_swap_waits == refusals
    assert events == ["arrival"]


def test_refusals_wait_for_the_next_state_and_end_in_a_503_after_the_swap_wait(monkeypatch):
    """A rank refuses the adapter while the published state still lists it resident: the request
    waits for the newer state (the coordinator publishes evictions first) instead of going straight
    back, and once refusals outlast `swap_wait_s` it gets the swap's 503."""
    async def script(rank, attempt, request_id):
        async def publish_later():
            await asyncio.sleep(0.05)
            router.update(_with_adapter(serving("old"), ()))  # a new state, the adapter resident again

        asyncio.get_running_loop().create_task(publish_later())
        raise UnknownAdapterError("law")
        yield  # pragma: no cover - a generator

    client, router, calls, events = _client(monkeypatch, script)
    router.update(_with_adapter(serving("old"), ()))
    client.swap_wait_s = 0.3

    async def main():
        loop = asyncio.get_running_loop()
        started = loop.time()
        with pytest.raises(OpenAIError) as info:
            await _drain(client.generate(_law()))
        return info.value, loop.time() - started

    error, elapsed = asyncio.run(main())
    assert error.status_code == 503 and "swapped in" in str(error)
    assert elapsed >= 0.3 and len(calls) <= 0.3 / 0.05 + 2  # one try per new state, not a busy loop
    assert events == ["arrival", "failed"] and client.num_queued == 0


def test_a_refusal_no_new_state_explains_is_the_ranks_error(monkeypatch):
    """A rank refuses an adapter the state lists resident and no new state follows: no swap is
    under way, so the rank's `UnknownAdapterError` stands (after one state wait, not a loop)."""
    async def script(rank, attempt, request_id):
        raise UnknownAdapterError("law")
        yield  # pragma: no cover - a generator

    client, router, calls, events = _client(monkeypatch, script)
    router.update(_with_adapter(serving("old"), ()))
    monkeypatch.setattr(engine_client, "_STATE_WAIT_S", 0.05)
    with pytest.raises(UnknownAdapterError):
        asyncio.run(_drain(client.generate(_law())))
    assert calls == ["old"] and events == ["arrival"]  # a client-side error (404), not a failure


def test_a_swap_whose_waiters_all_left_is_reported_unwanted(monkeypatch):
    """Both requests waiting for a swap-in are cancelled (clients gone) before it ends: the
    coordinator is told, once, so it does not hold the slot for them. A swap that still has a
    waiter is not reported."""
    async def script(rank, attempt, request_id):
        yield _output(request_id, finished=True)

    client, router, calls, events = _client(monkeypatch, script)
    unwanted: list[str] = []
    client.swap_unwanted = unwanted.append

    async def main():
        done = asyncio.Event()

        async def make_resident(name):
            await done.wait()
            router.update(_with_adapter(serving("old"), ()))

        client.make_resident = make_resident
        router.update(_with_adapter(serving("old"), ("law",)))
        waiters = [asyncio.ensure_future(_drain(client.generate(_law(f"r{i}")))) for i in range(2)]
        await asyncio.sleep(0.01)
        for w in waiters:
            w.cancel()
        await asyncio.sleep(0.01)
        done.set()
        await asyncio.sleep(0.01)
        assert unwanted == ["law"] and calls == []

        done.clear()  # a second swap with a waiter that stays: streamed, nothing reported
        router.update(_with_adapter(serving("old"), ("law",)))
        staying = asyncio.ensure_future(_drain(client.generate(_law("r3"))))
        await asyncio.sleep(0.01)
        done.set()
        assert (await staying)[-1].finished and unwanted == ["law"]

    asyncio.run(main())
    assert client.num_queued == 0 and client._swap_waiters == {}


def test_an_adapter_not_swapped_in_in_time_is_a_503_and_an_unknown_one_a_404(monkeypatch):
    async def script(rank, attempt, request_id):
        raise UnknownAdapterError("law")
        yield  # pragma: no cover - a generator

    client, router, calls, events = _client(monkeypatch, script)
    router.update(_with_adapter(serving("old"), ("law",)))

    async def never(name):
        await asyncio.sleep(10)

    client.make_resident, client.swap_wait_s = never, 0.1
    with pytest.raises(OpenAIError) as info:
        asyncio.run(_drain(client.generate(_law())))
    assert info.value.status_code == 503 and "swapped in" in str(info.value) and calls == []
    router.update(dataclasses.replace(serving("old"), version=next(_versions)))  # unloaded meanwhile: not accepted
    with pytest.raises(UnknownAdapterError):
        asyncio.run(_drain(client.generate(_law("r2"))))
    assert events == ["arrival", "failed", "arrival"] and client.num_queued == 0


async def _drain(gen) -> list[RequestOutput]:
    return [o async for o in gen]
