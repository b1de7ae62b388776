"""The `n` choices of one request (`entrypoints/openai/choices.py`) over a stub engine: each
choice's seed, a choice refused at its start refusing the request with nothing left running, and
the merged stream ending (every choice aborted) at an error or when its reader leaves."""

from __future__ import annotations

import asyncio

import pytest

from elasticmoe.engine.engine_request import BASE_MODEL, EngineRequest
from elasticmoe.entrypoints.openai.choices import choice_params, merged, start_choices
from elasticmoe.outputs import RequestOutput
from elasticmoe.sampling_params import SEED_MAX, SamplingParams


def _out(request_id: str, token: int, finished: bool = False) -> RequestOutput:
    return RequestOutput(request_id, [1], [token], "x", [token], "x", finished=finished,
                         finish_reason="length" if finished else None)


class StubEngine:
    """`generate` yields `steps` outputs per request; requests whose id ends in a refused suffix
    raise at their start. Records which generators were closed before they finished."""

    def __init__(self, steps: int = 3, refuse: str | None = None) -> None:
        self.steps, self.refuse = steps, refuse
        self.submitted: list[EngineRequest] = []
        self.closed_early: list[str] = []

    async def generate(self, request: EngineRequest):
        self.submitted.append(request)
        if self.refuse is not None and request.request_id.endswith(self.refuse):
            raise ValueError("refused")
        finished = False
        try:
            for step in range(self.steps):
                await asyncio.sleep(0.001)
                finished = step == self.steps - 1
                yield _out(request.request_id, step, finished)
        finally:
            if not finished:
                self.closed_early.append(request.request_id)


def test_each_choice_has_its_own_seed_wrapping_at_64_bits():
    params = SamplingParams(temperature=1.0, seed=7)
    assert [choice_params(params, i).seed for i in range(3)] == [7, 8, 9]
    assert choice_params(SamplingParams(temperature=1.0, seed=SEED_MAX), 2).seed == 1  # 2^64 + 1 wraps to 1
    unseeded = SamplingParams(temperature=1.0)
    assert choice_params(unseeded, 2) is unseeded


def test_choices_start_together_with_ids_per_choice():
    engine = StubEngine()
    started = asyncio.run(start_choices(engine, "cmpl-a", [1], SamplingParams(seed=3), BASE_MODEL, 3))
    assert [s.request_id for s in started] == ["cmpl-a-0", "cmpl-a-1", "cmpl-a-2"]
    assert all(0 < s.ttft_s < 1 for s in started)  # each its own, from the common start
    assert [r.params.seed for r in engine.submitted] == [3, 4, 5]
    single = asyncio.run(start_choices(StubEngine(), "cmpl-b", [1], SamplingParams(), BASE_MODEL, 1))
    assert [s.request_id for s in single] == ["cmpl-b"]  # one choice keeps the request's id


def test_a_choice_refused_at_its_start_refuses_the_request_and_aborts_the_others():
    engine = StubEngine(steps=50, refuse="-2")

    async def main() -> None:
        with pytest.raises(ValueError, match="refused"):
            await start_choices(engine, "cmpl-a", [1], SamplingParams(), BASE_MODEL, 3)
        await asyncio.sleep(0.01)

    asyncio.run(main())
    assert sorted(engine.closed_early) == ["cmpl-a-0", "cmpl-a-1"]


async def _stream(choice):
    async for out in choice.outputs():
        yield out


def test_the_merged_stream_carries_every_choice_to_its_end():
    async def main() -> list[tuple[int, RequestOutput]]:
        started = await start_choices(StubEngine(steps=4), "c", [1], SamplingParams(), BASE_MODEL, 3)
        return [item async for item in merged(started, _stream)]

    items = asyncio.run(main())
    assert sorted(i for i, _ in items) == [0] * 4 + [1] * 4 + [2] * 4
    assert {i for i, out in items if out.finished} == {0, 1, 2}


def test_an_error_event_ends_the_merged_stream_and_aborts_the_other_choices():
    engine = StubEngine(steps=50)

    async def with_error(choice):
        async for out in choice.outputs():
            yield out
            if choice.request_id.endswith("-1") and out.new_token_ids == [2]:
                yield "data: error\n\n"
                return

    async def main() -> list:
        started = await start_choices(engine, "c", [1], SamplingParams(), BASE_MODEL, 3)
        items = [item async for item in merged(started, with_error)]
        await asyncio.sleep(0.01)
        return items

    items = asyncio.run(main())
    assert items[-1] == (1, "data: error\n\n")
    assert sorted(engine.closed_early) == ["c-0", "c-1", "c-2"]


def test_a_reader_that_leaves_aborts_every_choice():
    engine = StubEngine(steps=50)

    async def main() -> None:
        started = await start_choices(engine, "c", [1], SamplingParams(), BASE_MODEL, 2)
        stream = merged(started, _stream)
        await anext(stream)
        await stream.aclose()
        await asyncio.sleep(0.01)

    asyncio.run(main())
    assert sorted(engine.closed_early) == ["c-0", "c-1"]


@pytest.mark.parametrize("n", [1, 2])
def test_closing_a_stream_between_chunks_aborts_every_choice(n):
    """The server closes a stream whose client went away while the stream waits at a chunk (a
    failed write): every choice's engine request is aborted, none runs on."""
    import time

    from fake_engine import FakeEngine

    from elasticmoe.engine.async_llm import AsyncLLM
    from elasticmoe.entrypoints.openai.protocol import CompletionRequest
    from elasticmoe.entrypoints.openai.serving import OpenAIServing

    engine = FakeEngine(max_model_len=100_000, step_delay_s=0.001)
    llm = AsyncLLM(engine)
    llm.start()
    try:
        serving = OpenAIServing(llm, "fake")

        async def main() -> None:
            stream = await serving.create_completion(
                CompletionRequest(model="fake", prompt="a b", max_tokens=50_000, n=n, stream=True))
            chunks = aiter(stream)
            for _ in range(4):
                await anext(chunks)
            await stream.aclose()

        asyncio.run(main())
        deadline = time.monotonic() + 10
        while engine.requests and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not engine.requests, f"choices still running: {list(engine.requests)}"
    finally:
        llm.shutdown()


def test_all_or_none_cancels_the_others_when_one_fails():
    from elasticmoe.entrypoints.openai.choices import all_or_none

    cancelled = []

    async def slow(i: int) -> int:
        try:
            await asyncio.sleep(10)
        except asyncio.CancelledError:
            cancelled.append(i)
            raise
        return i

    async def fails() -> int:
        await asyncio.sleep(0.01)
        raise KeyError("boom")

    async def main() -> None:
        assert await all_or_none([asyncio.sleep(0, result=1), asyncio.sleep(0, result=2)]) == [1, 2]
        assert await all_or_none([asyncio.sleep(0, result=3)]) == [3]
        with pytest.raises(KeyError):
            await all_or_none([slow(0), fails(), slow(2)])

    asyncio.run(main())
    assert sorted(cancelled) == [0, 2]
