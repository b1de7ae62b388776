"""`RouterEngineClient.generate` routes a request again when its rank was retired before it ran
(Ray's ActorDiedError, seen under load at a scale's switchover); when its rank dies after it
streamed, it continues on the replacement from what the client has (never twice the same
token), a bounded number of times; and the SLO estimator hears about arrivals and failures."""

from __future__ import annotations

import asyncio

import pytest
from ray.exceptions import ActorDiedError

import coordinator.engine_client as engine_client
from coordinator.active import ActiveInstance
from coordinator.engine_client import MAX_RECOVERIES, RouterEngineClient
from coordinator.router import Router
from elasticmoe.engine.engine_request import EngineRequest
from elasticmoe.entrypoints.openai.errors import OpenAIError
from elasticmoe.outputs import RequestOutput
from elasticmoe.sampling_params import SamplingParams


def serving(*ranks: str) -> ActiveInstance:
    """A snapshot of an instance with these ranks (the router sees nothing else of it)."""
    return ActiveInstance(None, ranks, (), max_model_len=64)

def _output(request_id: str, finished: bool) -> RequestOutput:
    return RequestOutput(request_id=request_id, prompt_token_ids=[1], new_token_ids=[7], new_text="x",
                         output_token_ids=[7], text="x", finished=finished,
                         finish_reason="length" if finished else None)


def _client(monkeypatch, script):
    """A client over ranks "old" and "new" whose streams follow `script(rank, attempt)`."""
    calls: list[str] = []

    async def fake_stream_from(rank, request, *args, **kwargs):
        calls.append(rank)
        sent.append(request)
        async for out in script(rank, len(calls), request.request_id):
            yield out

    sent: list[EngineRequest] = []

    monkeypatch.setattr(engine_client, "_stream_from", fake_stream_from)
    router: Router[str] = Router()
    router.set_active(serving("old"))
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
            router.set_active(serving("new"))  # the switchover happened meanwhile
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
            asyncio.get_running_loop().call_later(0.05, router.set_active, serving("new"))  # the watcher replaces it
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
        asyncio.get_running_loop().call_soon(router.set_active, serving(f"r{attempt}"))
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


def test_handover_markers_are_awaited_then_forgotten():
    import threading
    import time

    from imm.handover import HandoverRoutes

    routes = HandoverRoutes()
    assert routes.wait_markers(["a", "b"], 0.05) == {"a", "b"}  # nobody read them: timed out
    threading.Timer(0.05, routes.saw_marker, args=("a",)).start()
    threading.Timer(0.1, routes.saw_marker, args=("b",)).start()
    t0 = time.monotonic()
    assert routes.wait_markers(["a", "b"], 5.0) == set()
    assert time.monotonic() - t0 < 4.0
    assert routes.wait_markers(["a"], 0.0) == {"a"}  # forgotten once awaited


def test_a_waiting_handover_is_abandoned_when_its_export_died_half_way():
    import threading

    from imm.handover import HandoverAbandoned, HandoverRoutes

    routes = HandoverRoutes()
    errors: list[BaseException] = []

    def consumer() -> None:
        try:
            routes.take("exported", 30.0)
        except BaseException as exc:  # noqa: BLE001 - examined below
            errors.append(exc)

    thread = threading.Thread(target=consumer)
    thread.start()
    routes.abandon_waiting()  # the old instance died after exporting some of its requests
    thread.join(5)
    assert not thread.is_alive() and isinstance(errors[0], HandoverAbandoned)
    assert isinstance(errors[0], engine_client.EngineDeadError)  # the engine client resumes it elsewhere
    routes.publish({"later": "rank"})  # a later handover is not affected
    assert routes.take("later", 1.0) == "rank"
    with pytest.raises(HandoverAbandoned):
        routes.take("never", 0.05)  # no route in time: resumed from the client's side too
