"""`LockstepAsyncLLM`: `AsyncLLM` whose loop thread steps in lockstep with the other EP ranks.

Under expert parallelism every rank must call `engine.step()` the same number of
times, or the MoE all-to-all of a busy rank waits forever for an idle partner.
The plain `AsyncLLM` loop blocks on its command queue when its own engine is
idle, so it cannot be used for ep_size > 1. This loop instead runs rounds:

1. apply every queued command (add / abort / call) to the engine;
2. one `all_reduce(MAX)` over the instance group of `[has_work, stop_code]`
   (stop_code 0: run, 1: pause, 2: stop; without a group the local values count);
3. if any rank wants to stop or pause: every rank leaves the loop in this same
   round (a stop wins over a pause); if any rank waits for a LoRA adapter that is in host
   memory only, every rank takes part in one more exchange (the adapters wanted, the slots in
   use) and applies the same swaps (`engine.lora_lockstep`); if any rank has work: every rank
   steps (idle ranks run an empty forward); otherwise wait for a command
   (with a group: up to `idle_wait_s`, doubling with every idle round in a row up to
   `max_idle_wait_s`; without one: blocking), then the next round.

NOTE: with a group an idle rank cannot block: a peer's request needs it in the next round's
all_reduce. At a fixed 2 ms wait an idle dp-2 instance ran ~500 rounds a second and each rank
burnt about a quarter of a core doing nothing. With the back-off an idle instance runs a few
rounds a second. So that the first request after a quiet spell does not wait for the peers' long
waits to end, the rank it reaches wakes them (`wake_peers`, set by the rank: a message to each
peer's `wake`) before it enters the round; a lost wake costs at most `max_idle_wait_s`. Any round
with work starts the waits again at `idle_wait_s`. (vLLM's data-parallel engines do the same:
they sleep when every engine is idle and a coordinator wakes them all for the next wave.)

A *pause* leaves the loop without failing the consumers: their streams wait
until `export_requests` hands each request over (its stream then raises
`HandedOver`, which `InstanceRank.generate` turns into a marker output). A
*stop* fails every waiting consumer with `EngineDeadError`.

Invariants: all ranks run the same number of rounds and steps; a stop or pause
requested on one rank ends all ranks at the same round boundary (a step
boundary), so no collective is left half-entered. The group is used only from
the loop thread; the engine only from the loop thread while it runs, and from
the caller of `export_requests` once it has paused (the thread has exited).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import threading
import time
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from elasticmoe.engine.async_llm import (
    AbortCommand,
    AddCommand,
    AsyncLLM,
    CallCommand,
    EngineCore,
    EngineDeadError,
    StopCommand,
    Stream,
    call_soon,
)
from elasticmoe.outputs import RequestOutput
from imm.handover import HandedOver

logger = logging.getLogger(__name__)

_RUN, _PAUSE, _STOP = 0, 1, 2
_ADOPTED_TTL_S = 600.0  # an adopted stream nobody resumed for this long is forgotten


class _Pause(StopCommand):
    """Leave the loop at the next round boundary, keeping the consumers waiting."""


def _nothing() -> None:
    return None


@dataclass(slots=True)
class _Wake(CallCommand):
    """A peer has work: end this rank's idle wait and join the next round now (a call of nothing)."""

    fn: Callable[[], Any] = _nothing


class LockstepAsyncLLM(AsyncLLM):
    """`AsyncLLM` for one rank of an EP group; `group=None` runs the same loop on one rank."""

    def __init__(
        self,
        engine: EngineCore,
        group: dist.ProcessGroup | None,
        *,
        idle_wait_s: float = 0.002,
        max_idle_wait_s: float = 0.25,
        wake_peers: Callable[[], None] | None = None,
        stall_timeout_s: float = 60.0,
    ) -> None:
        super().__init__(engine, stall_timeout_s=stall_timeout_s)
        self.group = group
        self.idle_wait_s = idle_wait_s
        self.max_idle_wait_s = max(idle_wait_s, max_idle_wait_s)
        self._idle_wait_s = idle_wait_s  # this idle round's wait (see the module docstring)
        self.wake_peers = wake_peers  # called on the loop thread; must not block
        self.num_wakes_sent = 0
        self.num_rounds = 0
        self.num_steps = 0
        # Adopted streams until their `resume` (monotonic adoption time): a short request can
        # finish here (leaving `_streams`) before its client, busy elsewhere, calls `resume`.
        self._adopted: dict[str, tuple[float, Stream]] = {}
        self.is_paused = False
        self.pause_requested = False  # set before the loop is asked to pause; new requests are turned away

    # ---- pause / handover ---------------------------------------------------------------

    def pause(self, timeout_s: float = 30.0) -> None:
        """Stop the loop at a round boundary (all ranks of the group, same round) without
        failing the consumers. NOTE: every rank of the group ends its loop in that round,
        whether it asked for the pause or not; a concurrent stop wins and fails them."""
        thread = self._thread
        if thread is None:
            raise EngineDeadError("pause: the engine loop was never started")
        self.pause_requested = True
        if thread.is_alive():
            self._commands.put(_Pause())
            thread.join(timeout_s)
            if thread.is_alive():
                raise TimeoutError(f"pause: the loop did not reach a round boundary in {timeout_s:.0f}s")
        if not self.is_paused:  # a peer's stop, a crash, or a shutdown came first
            raise EngineDeadError(f"pause: the loop stopped instead ({self._error!r})")

    def unpause(self) -> None:
        """Run the loop again after a pause (a switchover that rolled back). NOTE: every rank of
        the group must unpause, or the others hang in the round's all_reduce."""
        thread = self._thread
        if not self.is_paused or thread is None or thread.is_alive():
            raise RuntimeError("unpause: the loop is not paused")
        self.is_paused, self._stopping, self.pause_requested = False, False, False
        self._last_tick = time.monotonic()
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self._thread.start()

    def wake(self) -> None:
        """A peer rank got work while the instance was idle: join the next round now."""
        self._commands.put(_Wake())

    def apply_queued_commands(self) -> None:
        """After a pause, on the caller's thread: apply the adds and aborts that arrived too late
        for the loop (so those requests are exported too) and fail any pending `CallCommand`."""
        if not self.is_paused:
            raise RuntimeError("apply_queued_commands: not paused")
        while True:
            try:
                command: Any = self._commands.get_nowait()
            except queue.Empty:
                return
            if isinstance(command, CallCommand):
                command.error = EngineDeadError("engine paused")
                command.done.set()
            elif isinstance(command, AddCommand | AbortCommand):
                self._apply(command)

    def hand_over_streams(self, request_ids: list[str]) -> None:
        """End the streams of the exported `request_ids` with `HandedOver`, and fail any other
        stream still waiting (a request the engine never saw). Call after exporting."""
        exported = set(request_ids)
        with self._lock:
            streams, self._streams = self._streams, {}
        for request_id, stream in streams.items():
            item: BaseException = (
                HandedOver(request_id) if request_id in exported else EngineDeadError("engine paused")
            )
            call_soon(stream.loop, stream.queue.put_nowait, item)

    def adopt_streams(self, request_ids: list[str]) -> None:
        """Register a stream (on the caller's event loop) per imported request; `resume` reads it.
        NOTE: call before the import reaches the engine, or its first outputs have no stream."""
        loop = asyncio.get_running_loop()
        now = time.monotonic()
        with self._lock:
            clash = [r for r in request_ids if r in self._streams]
            if clash:
                raise ValueError(f"requests {clash} already have a stream here")
            # A client that never came back (it went away during the handover) leaves its entry;
            # drop those long past any handover timeout.
            for request_id, (adopted_at, _) in list(self._adopted.items()):
                if now - adopted_at > _ADOPTED_TTL_S:
                    del self._adopted[request_id]
            for request_id in request_ids:
                stream = Stream(loop, asyncio.Queue())
                self._streams[request_id] = stream
                self._adopted[request_id] = (now, stream)

    def unresumed(self, request_ids: list[str]) -> list[str]:
        """The adopted requests among `request_ids` whose `resume` has not been called yet."""
        with self._lock:
            return [r for r in request_ids if r in self._adopted]

    def drop_streams(self, request_ids: list[str]) -> None:
        """Forget adopted streams whose import failed (nothing will be delivered to them)."""
        for request_id in request_ids:
            self._forget(request_id)
            with self._lock:
                self._adopted.pop(request_id, None)

    async def resume(self, request_id: str) -> AsyncGenerator[RequestOutput, None]:
        """Stream an adopted request's outputs until one is finished (like `generate` after
        the add). Leaving early aborts the request in the engine."""
        with self._lock:
            adopted = self._adopted.pop(request_id, None)
        if adopted is None:
            raise KeyError(f"no handed-over request {request_id!r} here")
        stream = adopted[1]  # its queue holds every output, the finished one too
        async with contextlib.aclosing(self._consume(request_id, stream, report_abort=False)) as outputs:
            async for output in outputs:
                yield output

    # ---- loop thread --------------------------------------------------------------------

    def _run(self) -> None:
        logger.info("lockstep loop started (group=%s)", self.group is not None)
        stop_code = _RUN
        agreed = _RUN
        try:
            while True:
                stop_code = max(stop_code, self._drain_commands())
                has_work = self.engine.has_unfinished_requests()
                wants = self._lora_wants()
                # NOTE: every rank must reach this all_reduce once per round; never `continue`
                # or `return` between rounds without it, or the other ranks hang in gloo.
                flags = torch.tensor([int(has_work), stop_code, int(bool(wants and wants[0]))])
                if self.group is not None:
                    dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self.group)
                any_work, agreed = bool(flags[0]), int(flags[1])
                self.num_rounds += 1
                self._last_tick = time.monotonic()
                if agreed != _RUN:
                    return
                if flags[2] and wants is not None:
                    self._swap_lora_in_lockstep(*wants)  # NOTE: a collective too: every rank, this round
                self._has_work = any_work
                if any_work:
                    self._idle_wait_s = self.idle_wait_s
                    # NOTE: with a group, a step that raised may have left a peer inside an
                    # all-to-all: crash (the coordinator replaces the instance); alone, fail its requests.
                    outputs = self._step() if self.group is None else self.engine.step()
                    self.num_steps += 1  # NOTE: before the outputs reach their consumers (stats agree with them)
                    self._deliver(outputs)
                    self._pace(self._last_tick)
                    self._count_requests()
                else:
                    # NOTE: counted before the wait, which lasts until the next command: an abort
                    # that left the engine idle must not read as a running request until then.
                    self._count_requests()
                    stop_code = max(stop_code, self._wait_for_command())
        except BaseException as exc:  # noqa: BLE001 - any crash must reach the consumers
            logger.exception("lockstep loop crashed")
            self._error = exc
        finally:
            # A stop agreed by a peer ends this rank too: its consumers must not wait forever.
            # A pause keeps them: `export_requests` + `hand_over_streams` end their streams.
            self.is_paused = agreed == _PAUSE and self._error is None
            self._stopping = True
            if not self.is_paused:
                reason = f"engine loop crashed: {self._error!r}" if self._error else "engine loop stopped"
                self._fail_all(EngineDeadError(reason))
            logger.info(
                "lockstep loop %s after %d rounds, %d steps",
                "paused" if self.is_paused else "stopped", self.num_rounds, self.num_steps,
            )

    def _lora_wants(self) -> tuple[list[int], list[int]] | None:
        """(adapter ids this rank waits for, LoRA slots its live requests use), or None when the
        engine swaps LoRA adapters on its own (one rank, or no LoRA)."""
        adapters = getattr(self.engine, "adapters", None)
        lockstep = getattr(adapters, "lockstep_lora", None)
        if lockstep is None or self.group is None:
            return None
        return lockstep.wants(r.binding.lora_names for r in adapters.live())  # type: ignore[union-attr]

    def _swap_lora_in_lockstep(self, wanted: list[int], used: list[int]) -> None:
        """Gather every rank's wants and apply the same swaps on each (`engine.lora_lockstep`)."""
        lockstep = self.engine.adapters.lockstep_lora  # type: ignore[attr-defined]
        mine = torch.tensor(lockstep.row(wanted), dtype=torch.int64)
        everyone = [torch.empty_like(mine) for _ in range(dist.get_world_size(self.group))]
        dist.all_gather(everyone, mine, group=self.group)
        slots = torch.zeros(3, lockstep.num_slots, dtype=torch.int64)  # [in use, queued, used since the plan]
        slots[0, used] = 1
        slots[1, lockstep.queued_slots()] = 1
        slots[2, lockstep.used_since_plan()] = 1
        dist.all_reduce(slots, op=dist.ReduceOp.MAX, group=self.group)
        in_use, in_queue, used_since = ({i for i, flag in enumerate(row) if flag} for row in slots.tolist())
        swapped = lockstep.apply_gathered([t.tolist() for t in everyone], in_use, in_queue, used_since)
        if swapped:
            logger.info("lora: swapped in %s on every rank (round %d)", swapped, self.num_rounds)

    def _drain_commands(self) -> int:
        """Apply all queued commands without blocking; the highest stop code among them."""
        code = _RUN
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return code
            code = max(code, self._apply_lockstep(command))

    def _wait_for_command(self) -> int:
        """Idle: block until a command arrives (with a group: or this round's wait passes, and the
        next one waits twice as long, up to `max_idle_wait_s`); apply it."""
        timeout = self._idle_wait_s if self.group is not None else None
        try:
            command = self._commands.get(timeout=timeout)
        except queue.Empty:
            self._idle_wait_s = min(self._idle_wait_s * 2, self.max_idle_wait_s)
            return _RUN
        if timeout is not None and timeout > self.idle_wait_s and not isinstance(command, _Wake):
            self._wake_peers()  # they may be in a long wait: this round should not wait for them
        self._idle_wait_s = self.idle_wait_s
        # NOTE: a stop or pause returned here still goes through the next all_reduce.
        return self._apply_lockstep(command)

    def _wake_peers(self) -> None:
        if self.wake_peers is None:
            return
        try:
            self.wake_peers()
            self.num_wakes_sent += 1
        except Exception:  # noqa: BLE001 - a peer that cannot be told joins when its wait ends
            logger.warning("could not wake the peer ranks", exc_info=True)

    def _apply_lockstep(self, command: Any) -> int:
        if isinstance(command, _Pause):
            return _PAUSE
        if isinstance(command, StopCommand):
            return _STOP
        if isinstance(command, CallCommand):
            command.run()
            return _RUN
        assert isinstance(command, AddCommand | AbortCommand)
        self._apply(command)
        return _RUN
