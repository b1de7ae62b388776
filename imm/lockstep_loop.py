"""`LockstepAsyncLLM`: `AsyncLLM` whose loop thread steps in lockstep with the other EP ranks.

Under expert parallelism every rank must call `engine.step()` the same number of
times, or the MoE all-to-all of a busy rank waits forever for an idle partner.
The plain `AsyncLLM` loop blocks on its command queue when its own engine is
idle, so it cannot be used for ep_size > 1. This loop instead runs rounds:

1. apply every queued command (add / abort) to the engine;
2. one `all_reduce(MAX)` over the instance group of `[has_work, wants_stop]`;
3. if any rank wants to stop: every rank leaves the loop in this same round;
   if any rank has work: every rank steps (idle ranks run an empty forward);
   otherwise wait up to `idle_wait_s` for a command, then start the next round.

Invariants: all ranks run the same number of rounds and steps; a stop requested
on one rank stops all ranks at the same round boundary (a step boundary), so no
collective is left half-entered. The group is used only from the loop thread.
"""

from __future__ import annotations

import logging
import queue
import time

import torch
import torch.distributed as dist

from elasticmoe.engine.async_llm import AsyncLLM, EngineCore, EngineDeadError, _Abort, _Add, _Stop

logger = logging.getLogger(__name__)


class LockstepAsyncLLM(AsyncLLM):
    """`AsyncLLM` for one rank of an EP group; `group=None` falls back to the single-rank loop."""

    def __init__(
        self,
        engine: EngineCore,
        group: dist.ProcessGroup | None,
        *,
        idle_wait_s: float = 0.002,
        stall_timeout_s: float = 60.0,
    ) -> None:
        super().__init__(engine, stall_timeout_s=stall_timeout_s)
        self.group = group
        self.idle_wait_s = idle_wait_s
        self.num_rounds = 0
        self.num_steps = 0

    def _run(self) -> None:
        if self.group is None:
            super()._run()
            return
        logger.info("lockstep loop started")
        wants_stop = False
        try:
            while True:
                wants_stop = self._drain_commands() or wants_stop
                has_work = self.engine.has_unfinished_requests()
                # NOTE: every rank must reach this all_reduce once per round; never `continue`
                # or `return` between rounds without it, or the other ranks hang in gloo.
                flags = torch.tensor([int(has_work), int(wants_stop)])
                dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self.group)
                any_work, any_stop = bool(flags[0]), bool(flags[1])
                self.num_rounds += 1
                self._last_tick = time.monotonic()
                if any_stop:
                    return
                self._has_work = any_work
                if any_work:
                    self._deliver(self.engine.step())
                    self.num_steps += 1
                else:
                    self._wait_for_command()
                self.num_running = self.engine.num_running
                self.num_waiting = self.engine.num_waiting
        except BaseException as exc:  # noqa: BLE001 - any crash must reach the consumers
            logger.exception("lockstep loop crashed")
            self._error = exc
        finally:
            # A stop agreed by a peer ends this rank too: its consumers must not wait forever.
            self._stopping = True
            reason = f"engine loop crashed: {self._error!r}" if self._error else "engine loop stopped"
            self._fail_all(EngineDeadError(reason))
            logger.info("lockstep loop stopped after %d rounds, %d steps", self.num_rounds, self.num_steps)

    def _drain_commands(self) -> bool:
        """Apply all queued commands without blocking; True if a stop was among them."""
        wants_stop = False
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return wants_stop
            wants_stop = self._apply_lockstep(command) or wants_stop

    def _wait_for_command(self) -> None:
        """Idle: block until a command arrives or `idle_wait_s` passes, and apply it now."""
        try:
            command = self._commands.get(timeout=self.idle_wait_s)
        except queue.Empty:
            return
        if self._apply_lockstep(command):
            # NOTE: a stop must go through the next all_reduce, not end this rank alone.
            self._commands.put(_Stop())

    def _apply_lockstep(self, command: _Add | _Abort | _Stop) -> bool:
        if isinstance(command, _Stop):
            return True
        self._apply(command)
        return False
