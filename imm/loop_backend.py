"""`LoopBackend`: what both engine backends share, a `LockstepAsyncLLM` stepping a handover core.

A *handover core* is an engine the lockstep loop can step (`EngineCore`: add, step, abort, ...)
that can also give up its live requests as `RequestSnapshot`s and take snapshots in
(`export_requests` / `import_requests`): `LLMEngine` is one, `imm.vllm_core.VllmEngineCore`
another. Pausing at a step boundary, handing streams over and adopting them on the new rank are
the loop's (`imm.lockstep_loop`), so both backends splice streams the same way.

Subclasses set `core` (and `group`, for expert parallelism) in `attach`; `_import` may add what
their engine needs around an import (the native KV fence).

Invariants: the core is touched only by the loop thread once `start` ran, before that only by
`attach`, and after a pause only by the caller of `export_requests` / `reinstate`.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any, Protocol

from elasticmoe.engine.async_llm import EngineCore
from elasticmoe.engine.engine_request import EngineRequest
from elasticmoe.engine.handover import RequestSnapshot
from elasticmoe.outputs import RequestOutput
from imm.engine_backend import EngineCounters
from imm.lockstep_loop import LockstepAsyncLLM


class HandoverCore(EngineCore, Protocol):
    def export_requests(self, hand_over_kv: bool) -> list[RequestSnapshot]: ...
    def import_requests(self, snaps: list[RequestSnapshot], kv_is_shared: bool) -> None: ...


class LoopBackend:
    """The loop-driven half of an `EngineBackend` (see the module docstring)."""

    uses_ep_group = False

    def __init__(self) -> None:
        self.core: HandoverCore | None = None
        self.group: Any = None  # the instance's EP group (None: this rank steps alone)
        self.llm: LockstepAsyncLLM | None = None

    def _llm(self) -> LockstepAsyncLLM:
        if self.llm is None:
            raise RuntimeError("the step loop is not started")
        return self.llm

    def _core(self) -> HandoverCore:
        if self.core is None:
            raise RuntimeError("rank: not attached")
        return self.core

    # ---- serving ------------------------------------------------------------------------

    def start(self, wake_peers: Callable[[], None] | None = None) -> None:
        """Start the lockstep loop (idempotent). NOTE: with a group, every rank must be started.
        `wake_peers`: tells the other ranks this one has work (see `imm.lockstep_loop`)."""
        if self.llm is not None and self.llm.is_ready:
            return
        self.llm = LockstepAsyncLLM(self._core(), self.group, wake_peers=wake_peers)
        self.llm.start()

    def wake(self) -> None:
        if self.llm is not None:
            self.llm.wake()

    @property
    def is_started(self) -> bool:
        return self.llm is not None

    async def warm_up(self, request: EngineRequest) -> None:
        async for _ in self._llm().generate(request):
            pass

    def generate(self, request: EngineRequest) -> AsyncIterator[RequestOutput]:
        return self._llm().generate(request)

    def resume(self, request_id: str) -> AsyncIterator[RequestOutput]:
        return self._llm().resume(request_id)

    async def abort(self, request_id: str) -> None:
        await self._llm().abort(request_id)

    def check_health(self) -> None:
        self._llm().check_health()

    def counters(self) -> EngineCounters:
        llm = self.llm
        if llm is None:
            return EngineCounters()
        return EngineCounters(num_running=llm.num_running, num_waiting=llm.num_waiting, num_steps=llm.num_steps)

    @property
    def is_pausing(self) -> bool:
        llm = self.llm
        return llm is not None and (llm.pause_requested or llm.is_paused)

    @property
    def is_paused(self) -> bool:
        return self.llm is not None and self.llm.is_paused

    @property
    def max_model_len(self) -> int:
        return int(self._core().max_model_len)

    # ---- switchover ---------------------------------------------------------------------

    def pause(self) -> None:
        self._llm().pause()

    def export_requests(self, hand_over_kv: bool) -> list[RequestSnapshot]:
        """After `pause`: every live request (late adds included) leaves the engine as a snapshot."""
        llm = self._llm()
        if not llm.is_paused:
            raise RuntimeError("export_requests: pause first")
        llm.apply_queued_commands()
        return self._core().export_requests(hand_over_kv)

    def hand_over_streams(self, request_ids: list[str]) -> None:
        self._llm().hand_over_streams(request_ids)

    async def import_requests(self, snaps: Sequence[RequestSnapshot], kv_is_shared: bool) -> dict[str, int]:
        """Continue exported requests here (read each with `resume`); request id -> tokens whose KV
        it kept (0: recomputed)."""
        llm = self._llm()
        ids = [s.request_id for s in snaps]
        llm.adopt_streams(ids)
        try:
            return dict(await llm.run_on_loop(lambda: self._import(list(snaps), kv_is_shared)))
        except BaseException:
            llm.drop_streams(ids)
            raise

    def _import(self, snaps: list[RequestSnapshot], kv_is_shared: bool) -> dict[str, int]:
        """On the loop thread: the import itself (subclasses wrap it)."""
        self._core().import_requests(snaps, kv_is_shared)
        return {s.request_id: 0 for s in snaps}

    async def reinstate(self, snaps: Sequence[RequestSnapshot], kv_kept: bool) -> None:
        """Undo a pause and export: take the exported requests back (read each with `resume`) and
        run the loop again."""
        llm, core = self._llm(), self._core()
        llm.apply_queued_commands()
        self._before_reinstate(snaps, kv_kept)
        llm.adopt_streams([s.request_id for s in snaps])
        core.import_requests(list(snaps), kv_is_shared=kv_kept)  # the loop is not running: safe here
        llm.unpause()

    def _before_reinstate(self, snaps: Sequence[RequestSnapshot], kv_kept: bool) -> None:
        """Hook: what the engine must undo of its export first (the native KV blocks)."""

    def unresumed(self, request_ids: list[str]) -> list[str]:
        return self._llm().unresumed(request_ids)

    # ---- teardown -----------------------------------------------------------------------

    async def stop(self) -> None:
        """Stop the loop at a step boundary (with a group: the other ranks stop in the same round)."""
        if self.llm is not None:
            await asyncio.to_thread(self.llm.shutdown)

    async def shutdown(self) -> None:
        await self.stop()
        self.llm = None
        self.core = None
