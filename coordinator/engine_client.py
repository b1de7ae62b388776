"""`RouterEngineClient`: the `EngineClient` of the OpenAI handlers, over the active instance's ranks.

Each `generate` call is admitted against a bound (`max_queued` requests waiting
at the router's gate or in flight; one more raises `QueueFull`, a 503), routed
by the `Router` to the least-loaded rank, and streamed back from
`InstanceRank.generate` (a Ray streaming generator, one `RequestOutput` per item).

Invariants:
- `num_queued` counts exactly the `generate` generators between their first
  `anext` and their close; the router's in-flight count covers the stream.
- A stream closed or cancelled before its finished output (client gone, handler
  cancelled) cancels the Ray generator, whose cleanup aborts the request in the
  rank's engine (its KV blocks are freed).
- Input errors raised by the rank (`ValueError` with `.param`) reach the handler
  unwrapped, before anything is yielded, so they become 400s.
- A request that reaches a rank already pausing for a switchover is turned away before
  anything is streamed (`RankPaused`) and routed again: it waits at the gate and runs on
  the new instance.
- A scale's switchover ends a rank stream with a `HandedOverOutput`; the stream then
  continues from the rank `HandoverRoutes` names (`rank.resume`), so the handler sees
  one unbroken stream (the marker is not passed on).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncGenerator, Callable
from typing import Any

import ray
from ray.exceptions import RayActorError, RayTaskError

from coordinator.router import NoActiveInstance, Router
from elasticmoe.entrypoints.openai.errors import OpenAIError
from elasticmoe.outputs import RequestOutput
from elasticmoe.sampling_params import SamplingParams
from imm.handover import HandedOverOutput, HandoverRoutes, RankPaused

logger = logging.getLogger(__name__)

_MAX_ROUTES = 5  # a request turned away by pausing ranks is routed again at most this often


def _nothing() -> None:
    pass


class QueueFull(OpenAIError):
    """More than `max_queued` requests waiting or in flight (HTTP 503 with `Retry-After`)."""

    def __init__(self, max_queued: int, retry_after_s: int) -> None:
        super().__init__(
            f"The server is at capacity ({max_queued} requests queued or running); retry later.",
            status_code=503,
        )
        self.retry_after_s = retry_after_s


class RouterEngineClient:
    """`generate` over Ray rank actors chosen by a `Router`; tokenizer and limits held locally."""

    def __init__(
        self,
        router: Router[Any],
        tokenizer: Any,
        max_model_len: int,
        max_queued: int,
        retry_after_s: int = 1,
        handover_routes: HandoverRoutes | None = None,
    ) -> None:
        if max_queued < 1:
            raise ValueError(f"max_queued: must be >= 1, got {max_queued}")
        self.router = router
        self._tokenizer = tokenizer
        self._max_model_len = max_model_len
        self.max_queued = max_queued
        self.retry_after_s = retry_after_s
        self.handover_routes = handover_routes or HandoverRoutes()
        self.num_queued = 0  # waiting at the gate + in flight
        self.num_rejected = 0
        self.adapters: tuple[str, ...] = ()  # ESFT adapters accepting requests (set by the adapter host)
        # The SLO estimator's inputs: every request offered, and every one that got no answer.
        self.on_arrival: Callable[[], None] = _nothing
        self.on_failed: Callable[[], None] = _nothing

    @property
    def tokenizer(self) -> Any:
        return self._tokenizer

    @property
    def max_model_len(self) -> int:
        return self._max_model_len

    def set_max_model_len(self, max_model_len: int) -> None:
        """The active instance's limit (the smallest over its ranks); set on each activation."""
        self._max_model_len = max_model_len

    def adapter_names(self) -> tuple[str, ...]:
        return self.adapters

    def set_adapters(self, names: tuple[str, ...]) -> None:
        """The ESFT adapters that accept requests (one tuple assignment: safe from any thread)."""
        self.adapters = tuple(names)

    async def generate(
        self,
        prompt: str | list[int],
        params: SamplingParams,
        request_id: str,
        adapter: str | None = None,
        lora_routing: dict | None = None,
    ) -> AsyncGenerator[RequestOutput, None]:
        """Stream `request_id`'s outputs from one rank; the last has `finished=True`."""
        self.on_arrival()
        if self.num_queued >= self.max_queued:
            self.num_rejected += 1
            self.on_failed()
            raise QueueFull(self.max_queued, self.retry_after_s)
        self.num_queued += 1
        try:
            for attempt in range(_MAX_ROUTES):
                streamed = False
                try:
                    async with self.router.route() as rank:
                        async for out in _stream_from(rank, request_id, prompt, params, self.handover_routes,
                                                      adapter, lora_routing):
                            streamed = True
                            yield out
                    return
                except RankPaused:
                    # Nothing was streamed; the gate holds the next route until the switchover ends.
                    logger.info("request %s reached a pausing rank; routing it again (%d)", request_id, attempt + 1)
                except RayActorError:
                    # The rank was retired while this call still waited in its queue (a scale ran in
                    # between): nothing reached the engine, so routing it again loses nothing.
                    if streamed:
                        raise
                    logger.info("request %s reached a retired rank; routing it again (%d)", request_id, attempt + 1)
            raise OpenAIError("No inference instance accepted the request; retry later.", status_code=503)
        except NoActiveInstance as exc:
            logger.warning("request %s: %s", request_id, exc)
            self.on_failed()
            raise OpenAIError("No inference instance is serving; retry later.", status_code=503) from exc
        except (GeneratorExit, asyncio.CancelledError, ValueError):
            raise  # the client went away or sent bad input: not the server's failure
        except OpenAIError as exc:
            if exc.status_code >= 500:
                self.on_failed()
            raise
        except Exception:
            self.on_failed()
            raise
        finally:
            self.num_queued -= 1


async def _stream_from(
    rank: Any,
    request_id: str,
    prompt: str | list[int],
    params: SamplingParams,
    routes: HandoverRoutes,
    adapter: str | None = None,
    lora_routing: dict | None = None,
    handover_timeout_s: float = 60.0,
) -> AsyncGenerator[RequestOutput, None]:
    """The rank's stream for one request, followed across handovers; cancels the current
    rank stream unless it reached its finished output."""
    stream = rank.generate.remote(request_id, prompt, params, adapter, lora_routing)
    while True:
        finished, handed_over = False, False
        try:
            async for ref in stream:
                try:
                    out: RequestOutput | HandedOverOutput = await ref
                except RayTaskError as exc:
                    raise _cause(exc) from None
                if isinstance(out, HandedOverOutput):
                    handed_over = True  # the marker is the stream's last item
                    routes.saw_marker(request_id)  # the scaler retires the old rank after this
                    continue
                finished = out.finished
                yield out
                if finished:
                    return
        finally:
            if not finished and not handed_over:
                # NOTE: cancelling the generator task runs the rank's cleanup, which aborts the
                # request in the engine; a stream that already ended makes this a no-op.
                ray.cancel(stream)
        if not handed_over:
            return
        # NOTE: the route is published inside the switchover's critical section, right after
        # the new instance imported the request; wait in a thread (HandoverRoutes blocks).
        new_rank = await asyncio.to_thread(routes.take, request_id, handover_timeout_s)
        stream = new_rank.resume.remote(request_id)


def _cause(exc: RayTaskError) -> BaseException:
    """The rank's own exception (keeps `.param` of input errors), else the Ray wrapper."""
    cause = getattr(exc, "cause", None)
    return cause if isinstance(cause, Exception) else exc
