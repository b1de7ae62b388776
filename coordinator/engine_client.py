"""`RouterEngineClient`: the ingress's `EngineClient` of the OpenAI handlers, over the published ranks.

Its limits and adapter names are those of the router's `RoutingState` (what the coordinator
published last): it keeps no copy of its own.

Each `generate` call is admitted against a bound (`max_queued` requests waiting
at the router's gate or in flight; one more raises `QueueFull`, a 503), routed
by the `Router` to the least-loaded rank, submitted there (`InstanceRank.submit`), and read
back from the rank's one batched stream for this ingress (`coordinator.rank_channels`): each
item an `OutputDelta`, from which the request's `RequestOutput`s are rebuilt here
(`OutputAccumulator`; the wire carries only what is new).

Invariants:
- `num_queued` counts exactly the `generate` generators between their first
  `anext` and their close; the router's in-flight count covers the stream.
- A stream closed or cancelled before its finished output (client gone, handler
  cancelled) aborts the request on its rank (its KV blocks are freed).
- Input errors raised by the rank (`ValueError` with `.param`) reach the handler
  unwrapped, before anything is yielded, so they become 400s.
- A request that reaches a rank already pausing for a switchover is turned away before
  anything is streamed (`RankPaused`) and routed again once the coordinator published the
  next state (the new instance, or the old one running again after a rollback).
- A request whose rank fails under it (the actor died, or its step loop ended because a peer
  of its EP group died) is not failed: the watcher is told (`on_rank_failure`), the request
  waits until the router no longer offers that rank (the instance was replaced, possibly by
  a restarted coordinator), and continues on the new instance from its prompt and the output
  tokens its client already has (`EngineRequest.resume`: the KV is recomputed, nothing is
  streamed twice). After `max_recoveries` such failures it gets a 503.
- A scale's switchover ends a request's items on its rank with a `HandedOverOutput` naming the
  rank that continues it (`rank.resume_into`), so the handler sees one unbroken stream (the
  marker is not passed on). A handover that never completes fails the stream like a dead rank.
- A request for an adapter the state lists as swapped out (an ESFT adapter beyond the slots)
  first waits for the coordinator to swap it in (`make_resident`; one call per adapter however
  many requests wait). One that still reaches a rank after its adapter was swapped out again is
  refused there before anything was streamed (`UnknownAdapterError`) and waits again, for the
  state that says so and then the swap, as often as it takes within `swap_wait_s` from its first
  refusal (then a 503 like any swap not done in time, never the 404 of an unknown adapter). A
  refusal no new state follows within `_STATE_WAIT_S` is not a swap's: the rank's error stands.
  A swap-in that ends with none of its waiters left (their clients went away) is reported
  (`swap_unwanted`): the coordinator then does not hold the adapter's slot for their arrival.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncGenerator, Awaitable, Callable
from typing import Any

from ray.exceptions import ActorUnavailableError, RayActorError, RayTaskError

from coordinator.rank_channels import ChannelClosed, RankChannels
from coordinator.router import NoActiveInstance, Router
from elasticmoe.engine.async_llm import EngineDeadError
from elasticmoe.engine.engine_request import EngineRequest
from elasticmoe.entrypoints.openai.errors import OpenAIError
from elasticmoe.errors import UnknownAdapterError, describe_error
from elasticmoe.outputs import OutputAccumulator, OutputDelta, RequestOutput
from imm.handover import HandedOverOutput, RankPaused
from imm.rank_streams import StreamFailure

logger = logging.getLogger(__name__)

_MAX_ROUTES = 5  # a request turned away by pausing ranks is routed again at most this often
_STATE_WAIT_S = 5.0  # a rank refused an adapter the state lists resident: how long the next state may take
MAX_RECOVERIES = 3  # an instance failure under one request is survived this often (a request that
# kills every instance it runs on is failed, not retried forever)
# What a rank's failure looks like from here: the actor died or is unreachable, or its step loop
# ended (a peer of its EP group died, its engine crashed).
_INSTANCE_FAILURES = (RayActorError, ActorUnavailableError, EngineDeadError)


class RankFailed(Exception):  # noqa: N818 - carries the failure of one rank to the retry loop
    """The rank a stream was reading from failed (`cause`): the request continues elsewhere."""

    def __init__(self, rank: Any, cause: BaseException) -> None:
        super().__init__(describe_error(cause))
        self.rank, self.cause = rank, cause


def _nothing() -> None:
    pass


def _ignore(rank: Any) -> None:
    pass


def _ignore_name(name: str) -> None:
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
        max_queued: int,
        retry_after_s: int = 1,
        on_rank_failure: Callable[[Any], None] = _ignore,
        max_recoveries: int = MAX_RECOVERIES,
        recovery_wait_s: float = 120.0,
        make_resident: Callable[[str], Awaitable[None]] | None = None,
        swap_wait_s: float = 300.0,
        swap_unwanted: Callable[[str], None] = _ignore_name,
    ) -> None:
        if max_queued < 1:
            raise ValueError(f"max_queued: must be >= 1, got {max_queued}")
        self.router = router
        self.channels = RankChannels()
        self._tokenizer = tokenizer
        self.max_queued = max_queued
        self.retry_after_s = retry_after_s
        self.on_rank_failure = on_rank_failure  # a stream saw this rank fail: check it now
        self.max_recoveries = max_recoveries
        self.recovery_wait_s = recovery_wait_s
        self.num_queued = 0  # waiting at the gate + in flight
        self.num_rejected = 0
        self.make_resident = make_resident  # swaps an adapter in (the coordinator); None: nothing is swapped
        self.swap_wait_s = swap_wait_s
        self._swaps: dict[str, asyncio.Future[None]] = {}  # adapter -> the one swap-in its requests wait for
        self._swap_waiters: dict[str, int] = {}  # adapter -> requests waiting for its swap-in now
        self.swap_unwanted = swap_unwanted  # a swap-in ended with none of its waiters left (the coordinator)
        self.num_swap_waits = 0  # requests that waited for their adapter's swap-in
        self.num_recovered = 0  # requests continued on another instance after theirs failed
        self.num_tokens_recomputed = 0  # output tokens those requests had, recomputed there
        # The SLO estimator's inputs: every request offered, and every one that got no answer.
        self.on_arrival: Callable[[], None] = _nothing
        self.on_failed: Callable[[], None] = _nothing
        self.on_adapter: Callable[[str], None] = _ignore_name  # a request for this adapter arrived

    @property
    def tokenizer(self) -> Any:
        return self._tokenizer

    @property
    def max_model_len(self) -> int:
        """The published instance's context limit (0 before the first one)."""
        state = self.router.state
        return state.max_model_len if state is not None else 0

    def adapter_names(self) -> tuple[str, ...]:
        """The adapters accepting requests (the router's state)."""
        state = self.router.state
        return state.adapters if state is not None else ()

    async def generate(self, request: EngineRequest) -> AsyncGenerator[RequestOutput, None]:
        """Stream `request`'s outputs from one rank; the last has `finished=True`. If the instance
        serving it fails, it continues on the next one (see the module docstring)."""
        self.on_arrival()
        adapter = request.adapter.name
        if adapter is not None:
            self.on_adapter(adapter)
        if self.num_queued >= self.max_queued:
            self.num_rejected += 1
            self.on_failed()
            raise QueueFull(self.max_queued, self.retry_after_s)
        self.num_queued += 1
        prompt = request.prompt if isinstance(request.prompt, list) else []
        progress = OutputAccumulator(prompt)
        try:
            num_routes = num_recoveries = 0
            refused_at: float | None = None  # when a rank first refused it for its adapter swapped out
            while True:
                rank, key = None, None
                try:
                    if adapter is not None and await self._wait_resident(adapter):
                        progress.waited_for_adapter = True
                    async with self.router.route(adapter, prompt, request.params.cache_salt) as route:
                        rank, key = route.rank, route.key
                        resumed = request.resumed(progress.output_token_ids, progress.num_chars)
                        async for out in _stream_from(rank, resumed, self.channels, progress):
                            yield out
                    return
                except RankPaused:
                    # Nothing was streamed; route again once the switchover published its outcome.
                    num_routes += 1
                    if num_routes >= _MAX_ROUTES:
                        raise OpenAIError("No inference instance accepted the request; retry later.",
                                          status_code=503) from None
                    logger.info("request %s reached a pausing rank; routing it again (%d)",
                                request.request_id, num_routes)
                    if key is not None:
                        await self.router.wait_newer(key, self.router.max_hold_s)
                except UnknownAdapterError as exc:
                    # Swapped out between our look at the state and the rank's admission: wait again.
                    state = self.router.state
                    if state is None or exc.adapter not in state.adapters:
                        raise  # unloaded meanwhile: a 404
                    now = asyncio.get_running_loop().time()
                    refused_at = now if refused_at is None else refused_at
                    if now - refused_at > self.swap_wait_s:
                        raise _not_swapped_in(exc.adapter, self.swap_wait_s) from exc
                    # NOTE: the coordinator publishes an eviction before the ranks refuse: a state
                    # still listing the adapter resident is about to be replaced (no busy loop). If
                    # none comes, no swap explains the refusal: the rank's error stands.
                    if exc.adapter not in state.swapped_out and not (
                            key is not None and await self.router.wait_newer(key, _STATE_WAIT_S)):
                        raise
                except (RankFailed, *_INSTANCE_FAILURES) as exc:
                    failed_rank, cause = (exc.rank, exc.cause) if isinstance(exc, RankFailed) else (rank, exc)
                    num_recoveries += 1
                    if num_recoveries > self.max_recoveries:
                        raise OpenAIError("The instances serving this request failed repeatedly; retry later.",
                                          status_code=503) from cause
                    await self._await_recovery(request.request_id, failed_rank, progress, cause)
        except NoActiveInstance as exc:
            logger.warning("request %s: %s", request.request_id, exc)
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

    async def _wait_resident(self, adapter: str) -> bool:
        """Return once `adapter` is resident (at once unless the state lists it as swapped out);
        whether it waited."""
        state = self.router.state
        if self.make_resident is None or state is None or adapter not in state.swapped_out:
            return False
        self.num_swap_waits += 1
        swap = self._swaps.get(adapter)
        if swap is None:
            swap = self._swaps[adapter] = asyncio.ensure_future(self.make_resident(adapter))
            swap.add_done_callback(lambda done: self._swap_done(adapter, done))
        self._swap_waiters[adapter] = self._swap_waiters.get(adapter, 0) + 1
        try:
            await asyncio.wait_for(asyncio.shield(swap), self.swap_wait_s)  # NOTE: the swap outlives one waiter
            is_resident = await self.router.wait_resident(adapter, self.swap_wait_s)
        except TimeoutError:
            is_resident = False
        finally:
            self._swap_waiters[adapter] -= 1
            if not self._swap_waiters[adapter]:
                del self._swap_waiters[adapter]
        if not is_resident:
            raise _not_swapped_in(adapter, self.swap_wait_s)
        return True

    def _swap_done(self, adapter: str, swap: asyncio.Future[None]) -> None:
        """The swap-in of `adapter` ended. Its waiters resume after this callback: if none is left
        (their clients went away during the swap), none will reach a rank, so the coordinator is
        told not to hold the adapter's slot for them."""
        self._swaps.pop(adapter, None)
        if not swap.cancelled() and swap.exception() is None and not self._swap_waiters.get(adapter):
            self.swap_unwanted(adapter)

    async def _await_recovery(self, request_id: str, rank: Any, progress: OutputAccumulator, exc: BaseException) -> None:
        """The rank (or its whole instance) failed under this request: tell the watcher, and wait
        until the router no longer offers that rank (the instance was replaced), so the request
        is not sent back to the dead one. A rank of an instance that is already gone (a scale
        retired it meanwhile) is routed again at once."""
        logger.warning("request %s: its rank failed (%s) after %d output tokens; continuing it elsewhere",
                       request_id, describe_error(exc), len(progress.output_token_ids))
        if rank is not None:
            self.on_rank_failure(rank)
            if not await self.router.wait_replaced(rank, self.recovery_wait_s):
                raise NoActiveInstance(f"the failed instance was not replaced within {self.recovery_wait_s:.0f}s")
        if progress.output_token_ids:
            self.num_recovered += 1
            self.num_tokens_recomputed += len(progress.output_token_ids)


def _not_swapped_in(adapter: str, wait_s: float) -> OpenAIError:
    return OpenAIError(f"Adapter {adapter!r} was not swapped in within {wait_s:.0f}s; retry later.", status_code=503)


async def _stream_from(
    rank: Any, request: EngineRequest, channels: RankChannels, progress: OutputAccumulator
) -> AsyncGenerator[RequestOutput, None]:
    """One request's outputs, from `rank` and the ranks it is handed over to; aborts the request
    on its rank unless it reached its finished output."""
    request_id, subscriber = request.request_id, channels.subscriber
    channel = channels.of(rank)
    queue = channel.register(request_id)
    finished = False
    try:
        await _call(rank, rank.submit.remote(request, subscriber))
        while True:
            item = await queue.get()
            if isinstance(item, ChannelClosed):
                raise RankFailed(rank, item.cause)
            if isinstance(item, StreamFailure):
                error = item.error
                raise RankFailed(rank, error) if isinstance(error, _INSTANCE_FAILURES) else error
            if isinstance(item, HandedOverOutput):
                channel.unregister(request_id)
                rank, channel = item.next_rank, channels.of(item.next_rank)
                queue = channel.register(request_id)
                await _call(rank, rank.resume_into.remote(request_id, subscriber))
                continue
            assert isinstance(item, OutputDelta)
            out = progress.add(item)
            finished = out.finished
            yield out
            if finished:
                return
    finally:
        channel.unregister(request_id)
        if not finished:
            rank.abort.remote(request_id)  # NOTE: fire and forget; on a dead rank it is a no-op


async def _call(rank: Any, response: Any) -> Any:
    """A rank call's result; a failure of the rank raised as `RankFailed(rank)`, its own exception
    (an input error, `RankPaused`) as itself."""
    try:
        return await response
    except RayTaskError as exc:
        cause = _cause(exc)
        raise (RankFailed(rank, cause) if isinstance(cause, _INSTANCE_FAILURES) else cause) from None
    except _INSTANCE_FAILURES as exc:
        raise RankFailed(rank, exc) from None


def _cause(exc: RayTaskError) -> BaseException:
    """The rank's own exception (keeps `.param` of input errors), else the Ray wrapper."""
    cause = getattr(exc, "cause", None)
    return cause if isinstance(cause, Exception) else exc
