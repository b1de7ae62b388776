"""The `n` choices of one OpenAI request: n engine requests started together, then collected
together or streamed as one merged stream.

Each choice is an engine request of its own (`{id}-{i}` when n > 1), so everything a request
gets holds for each choice: its place in the batch, a handover or a resume on the elastic
server, an abort. With a seed, choice i samples with `seed + i` (as vLLM does), so the choices
differ and each is reproducible; greedy choices are equal, as OpenAI's are.

Failure rules:
- a choice refused at its start (a bad input, a full queue) refuses the request: the choices
  already started are aborted before the error is raised;
- a choice that fails later ends the request (an error event in a stream, a 500 otherwise) and
  the other choices are aborted;
- the client going away aborts every choice.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Sequence
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

from elasticmoe.engine.engine_request import AdapterRef, EngineRequest
from elasticmoe.entrypoints.openai.errors import internal_error
from elasticmoe.entrypoints.openai.responses import now
from elasticmoe.outputs import RequestOutput
from elasticmoe.sampling_params import SEED_MAX, SamplingParams

T = TypeVar("T")


class Generates(Protocol):
    def generate(self, request: EngineRequest) -> AsyncGenerator[RequestOutput, None]: ...


@dataclass(slots=True)
class Started:
    """One choice's engine request, accepted, with its first output already received."""

    request_id: str
    created: int
    start: float
    first: RequestOutput
    ttft_s: float
    source: AsyncGenerator[RequestOutput, None]
    adapter: str | None = None  # the adapter it asked for (None: the base model, or adapters per token)

    def adapter_state(self, out: RequestOutput) -> str | None:
        """"resident" (its adapter was in a slot on arrival) or "swapped" (it waited for the swap-in)
        as of `out` (the flag is kept once set), for a request that named an adapter; else None."""
        if self.adapter is None:
            return None
        return "swapped" if out.waited_for_adapter else "resident"

    async def outputs(self) -> AsyncIterator[RequestOutput]:
        yield self.first
        if not self.first.finished:
            async for out in self.source:
                yield out


# A response header naming a request's `Started.adapter_state`; absent for the base model. Known at
# the first token, so streams carry it too (docs/adapters.md).
ADAPTER_STATE_HEADER = "x-elasticmoe-adapter-state"


def choices_adapter_state(started: Sequence[Started]) -> str | None:
    """A response's `ADAPTER_STATE_HEADER` value: "swapped" if any of its choices waited, as of their
    first outputs."""
    states = {choice.adapter_state(choice.first) for choice in started}
    return "swapped" if "swapped" in states else states.pop() if len(states) == 1 else None


def choice_params(params: SamplingParams, index: int) -> SamplingParams:
    """Choice `index`'s parameters: its own seed (`seed + index`, wrapped into the 64 bits a seed
    takes) when one is given, else `params` itself."""
    if params.seed is None or index == 0:
        return params
    seed = params.seed + index
    return dataclasses.replace(params, seed=seed - 2**64 if seed > SEED_MAX else seed)


async def start_choices(engine: Generates, request_id: str, prompt_ids: list[int], params: SamplingParams,
                        adapter: AdapterRef, n: int) -> list[Started]:
    """Submit the request's `n` choices at once and wait for each one's first output, so input
    errors surface here (raised as the engine raised them). Nothing stays running on an error."""
    ids = [request_id] if n == 1 else [f"{request_id}-{i}" for i in range(n)]
    start = time.perf_counter()
    sources = [engine.generate(EngineRequest(rid, prompt_ids, choice_params(params, i), adapter))
               for i, rid in enumerate(ids)]
    try:
        firsts = await all_or_none([_first(s) for s in sources])
    except BaseException:
        for source in sources:
            await source.aclose()
        raise
    created = now()
    return [Started(rid, created, start, first, arrived - start, source, adapter.name)
            for rid, (first, arrived), source in zip(ids, firsts, sources, strict=True)]


async def _first(source: AsyncGenerator[RequestOutput, None]) -> tuple[RequestOutput, float]:
    """A choice's first output and when it came (its own time to first token)."""
    try:
        return await anext(source), time.perf_counter()
    except StopAsyncIteration:
        raise internal_error() from None


async def all_or_none(awaitables: Sequence[Awaitable[T]]) -> list[T]:
    """Await all concurrently; if one raises, cancel the others, wait for them, and raise its error
    (not an exception group: the caller's handlers map single errors to HTTP answers)."""
    if len(awaitables) == 1:  # no task on the common path
        return [await awaitables[0]]
    tasks = [asyncio.ensure_future(a) for a in awaitables]
    try:
        return list(await asyncio.gather(*tasks))
    except BaseException:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise


async def merged(started: Sequence[Started], stream: Callable[[Started], AsyncGenerator[Any, None]]
                 ) -> AsyncGenerator[tuple[int, Any], None]:
    """(choice index, item) as each choice's `stream` yields them, in arrival order. A str item (an
    error event) is the last: the other choices are aborted. Closing this aborts every choice, so a
    consumer must close it (`contextlib.aclosing`): left to the garbage collector, the choices'
    tasks would run on, and their engine streams could not be closed under them."""
    if len(started) == 1:  # no task or queue on the common path
        async with aclosing(stream(started[0])) as items:
            async for item in items:
                yield 0, item
        return
    queue: asyncio.Queue[tuple[int, Any]] = asyncio.Queue()
    done = object()

    async def pump(index: int, choice: Started) -> None:
        try:
            async with aclosing(stream(choice)) as items:
                async for item in items:
                    queue.put_nowait((index, item))
        finally:
            queue.put_nowait((index, done))

    tasks = [asyncio.create_task(pump(i, choice)) for i, choice in enumerate(started)]
    try:
        left = len(tasks)
        while left:
            index, item = await queue.get()
            if item is done:
                left -= 1
                continue
            yield index, item
            if isinstance(item, str):
                return
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for choice in started:
            await choice.source.aclose()
