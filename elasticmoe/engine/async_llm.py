"""`AsyncLLM`: an asyncio front end for one `LLMEngine`, stepped by a dedicated thread.

Threading model (the engine is not thread-safe):

- Only the loop thread calls the engine (`add_request`, `abort`, `step`); given a
  `build` function, `start` has it build the engine too (see `start` for why). Other
  threads talk to it through a command queue; when the engine has no work the
  thread blocks on that queue, so an idle server does not spin.
- Outputs travel back per request: the loop thread hands each step's outputs to
  the event loop of the request's consumer with one `call_soon_threadsafe` per
  loop and step, which puts them on that request's `asyncio.Queue`.
- A request leaves `_streams` exactly once: when its finished output is
  delivered, when `add_request` rejects it, when it is aborted, or when the
  engine dies. A consumer that stops early (break, cancellation, disconnect)
  aborts the request in the engine, so no engine memory outlives its consumer.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import os
import queue
import threading
import time
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass, field
from typing import Any, Protocol, cast

from elasticmoe.engine.engine_request import EngineRequest
from elasticmoe.outputs import RequestOutput

logger = logging.getLogger(__name__)

# A test knob, never set in production: the shortest time from one step's start to the next's. The
# e2e tests that keep clients streaming back to back while they scale, drain or kill (they check
# that requests in flight survive, not throughput) set it: at full speed the tiny model's four
# streams kept 1.6 of the machine's 2 cores busy while they ran.
MIN_STEP_INTERVAL_ENV = "ELASTICMOE_TEST_MIN_STEP_INTERVAL_S"


class EngineCore(Protocol):
    """The part of `LLMEngine` that `AsyncLLM` drives."""

    @property
    def tokenizer(self) -> Any: ...
    @property
    def max_model_len(self) -> int: ...
    @property
    def num_running(self) -> int: ...
    @property
    def num_waiting(self) -> int: ...

    def add(self, request: EngineRequest) -> None: ...
    def step(self) -> list[RequestOutput]: ...
    def fail_all(self, exc: BaseException) -> list[RequestOutput]: ...
    def abort(self, request_id: str) -> None: ...
    def has_unfinished_requests(self) -> bool: ...


class EngineDeadError(RuntimeError):
    """The engine loop is not running (never started, shut down, or crashed)."""


@dataclass(slots=True)
class AddCommand:
    """Queue `request` in the engine (its errors go to the request's consumer)."""

    request: EngineRequest


@dataclass(slots=True)
class CallCommand:
    """Run `fn` on the loop thread between steps; its result or error goes to `done`."""

    fn: Callable[[], Any]
    done: threading.Event = field(default_factory=threading.Event)
    result: Any = None
    error: BaseException | None = None

    def run(self) -> None:
        try:
            self.result = self.fn()
        except Exception as exc:  # noqa: BLE001 - the error belongs to the caller
            self.error = exc
        self.done.set()


@dataclass(slots=True)
class AbortCommand:
    request_id: str


class StopCommand:
    """Leave the loop at the next step boundary, failing every consumer still waiting."""


Command = AddCommand | AbortCommand | StopCommand | CallCommand


@dataclass(slots=True)
class Stream:
    """Where one request's outputs go: its consumer's event loop and queue."""

    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue[RequestOutput | BaseException | None]  # None: aborted from outside


class AsyncLLM:
    """Serve one engine to many asyncio consumers. Lifecycle: `start` -> `generate`* -> `shutdown`."""

    def __init__(self, engine: EngineCore | None = None, *, stall_timeout_s: float = 60.0) -> None:
        self.engine = cast(EngineCore, engine)  # None until `start(build)` has built it
        self.stall_timeout_s = stall_timeout_s
        self._commands: queue.Queue[Command] = queue.Queue()
        self._streams: dict[str, Stream] = {}
        self._lock = threading.Lock()  # guards _streams
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._error: BaseException | None = None
        self._has_work = False
        self._last_tick = time.monotonic()
        self.num_running = 0
        self.num_waiting = 0
        self.num_step_failures = 0  # steps that raised; their requests failed, the loop went on
        self.min_step_interval_s = float(os.environ.get(MIN_STEP_INTERVAL_ENV) or 0.0)

    # ------------------------------------------------------------ lifecycle

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    def start(self, build: Callable[[], EngineCore] | None = None) -> None:
        """Start the loop thread. With `build`, that thread first builds the engine, which then
        lives and steps on it alone; `start` returns once the engine is built and re-raises what
        `build` raised (no thread is left running then).

        Why build there: OpenMP keeps one thread team per thread that opens parallel regions. An
        engine built (and warmed up) on one thread and stepped on another leaves two teams in the
        process, and libgomp, counting more of its threads than CPUs, then lets every worker spin
        only briefly before sleeping: each of a step's parallel regions waits for a wake-up
        (measured, a closed loop of 64 requests: 1,099-1,251 output tok/s stepped on a second
        thread, 1,356-1,568 built and stepped on one)."""
        if self._thread is not None:
            return
        built: concurrent.futures.Future[None] = concurrent.futures.Future()

        def boot() -> None:
            if build is not None:
                try:
                    self.engine = build()
                except BaseException as exc:  # noqa: BLE001 - re-raised by start() on the caller's thread
                    built.set_exception(exc)
                    return
            built.set_result(None)
            self._run()

        self._thread = threading.Thread(target=boot, name="engine-loop", daemon=True)
        self._thread.start()
        try:
            built.result()
        except BaseException:
            self._thread.join()
            self._thread = None
            raise

    @property
    def is_ready(self) -> bool:
        return (
            self._thread is not None
            and self._thread.is_alive()
            and not self._stopping
            and self._error is None
        )

    def check_health(self) -> None:
        """Raise `EngineDeadError` if the loop is not running or has not ticked recently while it has work."""
        if self._error is not None:
            raise EngineDeadError(f"engine loop crashed: {self._error!r}")
        if self._thread is None or not self._thread.is_alive() or self._stopping:
            raise EngineDeadError("engine loop is not running")
        stalled_s = time.monotonic() - self._last_tick
        if self._has_work and stalled_s > self.stall_timeout_s:
            raise EngineDeadError(f"engine loop has not stepped for {stalled_s:.1f}s while it has work")

    def shutdown(self, timeout_s: float = 30.0) -> None:
        """Stop the loop thread; consumers still waiting get `EngineDeadError`. Idempotent."""
        self._stopping = True
        thread = self._thread
        if thread is not None and thread.is_alive():
            self._commands.put(StopCommand())
            thread.join(timeout_s)
            if thread.is_alive():
                logger.warning("engine loop did not stop within %.0fs", timeout_s)
        self._fail_all(EngineDeadError("engine was shut down"))
        close = getattr(self.engine, "close", None)  # the engine's own threads (expert prefetching)
        if close is not None:
            close()

    # ------------------------------------------------------------ client API

    def adapter_names(self) -> tuple[str, ...]:
        """ESFT adapters accepting requests (a snapshot the engine publishes; safe from any thread)."""
        adapters = getattr(self.engine, "adapters", None)  # `AdapterManager` (engines without one serve none)
        return tuple(adapters.served) if adapters is not None else ()

    async def run_on_loop(self, fn: Callable[[], Any]) -> Any:
        """Run `fn` on the loop thread between steps (so it may touch the engine); await its result."""
        if not self.is_ready:
            raise EngineDeadError("the engine loop is not running")
        call = CallCommand(fn)
        self._commands.put(call)
        await asyncio.to_thread(call.done.wait)
        if call.error is not None:
            raise call.error
        return call.result

    async def generate(self, request: EngineRequest) -> AsyncGenerator[RequestOutput, None]:
        """Yield this request's outputs until one has `finished=True`.

        Input errors from `LLMEngine.add` (a `ValueError` with `.param`)
        are raised here, before anything is yielded. If the request is aborted
        from elsewhere (`abort`), the last item has `finish_reason="abort"`.
        Leaving early aborts the request in the engine.
        """
        if not self.is_ready:
            self.check_health()
            raise EngineDeadError("engine loop is not running")
        request_id = request.request_id
        stream = Stream(asyncio.get_running_loop(), asyncio.Queue())
        with self._lock:
            if request_id in self._streams:
                raise ValueError(f"request id {request_id!r} is already running")
            self._streams[request_id] = stream
        self._commands.put(AddCommand(request))
        async with contextlib.aclosing(self._consume(request_id, stream, report_abort=True)) as outputs:
            async for output in outputs:
                yield output

    async def _consume(
        self, request_id: str, stream: Stream, *, report_abort: bool
    ) -> AsyncGenerator[RequestOutput, None]:
        """Yield a request's queued outputs until one is finished; leaving early aborts it
        in the engine. An abort from elsewhere ends the stream, with a final
        `finish_reason="abort"` output if `report_abort`."""
        done = False
        last: RequestOutput | None = None
        try:
            while True:
                item = await stream.queue.get()
                if isinstance(item, BaseException):
                    done = True
                    raise item
                if item is None:  # aborted via `abort()`
                    done = True
                    if report_abort:
                        yield _aborted_output(request_id, last)
                    return
                last = item
                done = item.finished
                yield item
                if done:
                    return
        finally:
            if not done:
                self._forget(request_id)
                self._commands.put(AbortCommand(request_id))

    async def abort(self, request_id: str) -> None:
        """Abort a request; its `generate` consumer (if any) ends with `finish_reason="abort"`."""
        stream = self._forget(request_id)
        self._commands.put(AbortCommand(request_id))
        if stream is not None:
            call_soon(stream.loop, stream.queue.put_nowait, None)

    # ------------------------------------------------------------ loop thread

    def _forget(self, request_id: str) -> Stream | None:
        with self._lock:
            return self._streams.pop(request_id, None)

    def _run(self) -> None:
        logger.info("engine loop started")
        try:
            while True:
                # NOTE: block only when the engine is idle; otherwise drain without waiting and step.
                if not self.engine.has_unfinished_requests():
                    self._has_work = False
                    command = self._commands.get()
                    self._has_work, self._last_tick = True, time.monotonic()
                    if not self._apply(command):
                        return
                while True:
                    try:
                        command = self._commands.get_nowait()
                    except queue.Empty:
                        break
                    if not self._apply(command):
                        return
                self._has_work = self.engine.has_unfinished_requests()
                self._last_tick = time.monotonic()
                if self._has_work:
                    self._deliver(self._step())
                    self._pace(self._last_tick)
                self._count_requests()
        except BaseException as exc:  # noqa: BLE001 - any crash must reach the consumers
            logger.exception("engine loop crashed")
            self._error = exc
            self._fail_all(EngineDeadError(f"engine loop crashed: {exc!r}"))
        finally:
            logger.info("engine loop stopped")

    def _count_requests(self) -> None:
        """What the stats read (`num_running`, `num_waiting`): the engine's as of now (loop thread)."""
        self.num_running = self.engine.num_running
        self.num_waiting = self.engine.num_waiting

    def _pace(self, step_started: float) -> None:
        """Hold the loop until `min_step_interval_s` has passed since `step_started` (see
        `MIN_STEP_INTERVAL_ENV`); commands that arrive meanwhile wait for the next round."""
        if self.min_step_interval_s > 0:
            time.sleep(max(0.0, step_started + self.min_step_interval_s - time.monotonic()))

    def _step(self) -> list[RequestOutput]:
        """One engine step. A step that raises (past the engine's per-request isolation) fails the
        requests it held, not the loop: one request must never stop serving."""
        try:
            return self.engine.step()
        except Exception as exc:  # noqa: BLE001 - reported to each request's consumer
            logger.exception("engine step failed; failing its %d live requests", self.engine.num_running)
            self.num_step_failures += 1
            return self.engine.fail_all(exc)

    def _apply(self, command: Command) -> bool:
        """Run one command on the engine; False means stop the loop."""
        if isinstance(command, StopCommand):
            return False
        if isinstance(command, CallCommand):
            command.run()
            return True
        if isinstance(command, AbortCommand):
            self.engine.abort(command.request_id)
            return True
        request = command.request
        with self._lock:
            stream = self._streams.get(request.request_id)
        if stream is None:  # consumer already gone
            return True
        try:
            self.engine.add(request)
        except Exception as exc:  # input errors belong to the caller of generate()
            self._forget(request.request_id)
            call_soon(stream.loop, stream.queue.put_nowait, exc)
        return True

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        """Route outputs to their consumers' queues, one wake-up per event loop."""
        batches: dict[asyncio.AbstractEventLoop, list[tuple[Stream, RequestOutput]]] = {}
        with self._lock:
            for out in outputs:
                stream = (
                    self._streams.pop(out.request_id, None)
                    if out.finished
                    else self._streams.get(out.request_id)
                )
                if stream is not None:
                    batches.setdefault(stream.loop, []).append((stream, out))
        for loop, batch in batches.items():
            call_soon(loop, _put_all, batch)

    def _fail_all(self, exc: BaseException) -> None:
        with self._lock:
            streams = list(self._streams.values())
            self._streams.clear()
        for stream in streams:
            call_soon(stream.loop, stream.queue.put_nowait, exc)


def _put_all(batch: list[tuple[Stream, RequestOutput]]) -> None:
    for stream, out in batch:
        stream.queue.put_nowait(out)


def call_soon(loop: asyncio.AbstractEventLoop, fn: Any, *args: Any) -> None:
    """Run `fn(*args)` on `loop` from any thread; a closed loop (its consumer gone) is ignored."""
    try:
        loop.call_soon_threadsafe(fn, *args)
    except RuntimeError:  # the consumer's loop is closed; nobody is listening
        pass


def _aborted_output(request_id: str, last: RequestOutput | None) -> RequestOutput:
    return RequestOutput(
        request_id=request_id,
        prompt_token_ids=list(last.prompt_token_ids) if last else [],
        new_token_ids=[],
        new_text="",
        output_token_ids=list(last.output_token_ids) if last else [],
        text=last.text if last else "",
        finished=True,
        finish_reason="abort",
    )
