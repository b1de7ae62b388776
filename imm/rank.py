"""`InstanceRank`: one DP rank of an inference instance, run as a Ray actor (`InstanceRankActor`).

The rank hosts one engine through an `EngineBackend` (`imm.engine_backend`: the native engine, or
vLLM) and owns what every engine shares: its EP group, its batched output streams and the routes
of the requests it handed over.

Lifecycle (driven by `imm.instance.Instance`, which checks the order):

    init_group -> build_skeleton   (standby: process up, group formed; native: config + tokenizer, no
                                    weights; vLLM: its engine built on a replica's HMM handles)
    attach                         (weights on this rank's HMM handles, used in place; no disk read)
    start -> warm_up               (step loop running; one short request went through)
    submit + outputs / abort       (serving; or generate per request)
    pause -> export_requests       (old rank at a switchover; see `imm.handover`)
    import_requests -> resume      (new rank at a switchover)
    route_handed_over              (old rank: its exported streams end naming the new rank)
    stop -> shutdown
    reuse                          (the process, pooled after its instance retired, becomes a rank of
                                    a new instance: `imm.rank_processes`)

It is an *async* actor. Outputs leave as `OutputDelta`s (the new tokens and text only), fed by
`LockstepAsyncLLM`'s per-request asyncio queues, in one of two ways: batched, one Ray stream per
subscriber for all its requests (`submit` / `resume_into` + `outputs`: what the ingress uses, see
`imm.rank_streams`), or one Ray streaming generator per request (`generate` / `resume`). Blocking
work (group rendezvous, engine build, loop join) runs in `asyncio.to_thread` so
`stats`/`check_health` stay responsive.

Invariants: the engine is touched only by the loop thread once `start` ran
(before that, only by `attach`; after a pause, only by `export_requests`); a
rank that exported never runs its engine again; a native rank attached with
`fence_kv=True` allocates no KV block until its first `import_requests`; the EP group is the
process's default gloo group (and vLLM keeps global state per process), so one process hosts
exactly one rank of one instance.
"""

from __future__ import annotations

import asyncio
import functools
import gc
import logging
import os
import time
import uuid
from collections.abc import AsyncGenerator, Mapping, Sequence
from typing import TYPE_CHECKING, Any, cast

import numpy as np
import ray

from elasticmoe.config import EngineOptions
from elasticmoe.engine.async_llm import EngineDeadError
from elasticmoe.engine.engine_request import EngineRequest
from elasticmoe.outputs import OutputDelta
from elasticmoe.parallel.expert_placement import ExpertPlacement
from elasticmoe.sampling_params import SamplingParams
from elasticmoe.utils.gc_heap import freeze_startup_heap, thaw_heap
from elasticmoe.utils.ports import free_port
from hmm.lifeline import in_ray_actor, watch_parent
from hmm.memory.page_table import SlotPages
from hmm.memory.segments import mapped_segments
from hmm.placement import node_address, ray_node_id
from imm.engine_backend import AttachResult, BackendName, make_backend
from imm.handover import HandedOver, HandedOverOutput, ImportReport, PendingRoutes, RankPaused
from imm.rank_stats import RankStats, rank_stats
from imm.rank_streams import RankStreams

# NOTE: nothing above loads PyTorch or the engine, and nothing here may: every process that
# receives a rank's actor handle imports this module (Ray loads the actor's class to make the
# handle), the ingress too, which holds one per rank and needs no tensors. The engine is
# imported when a rank builds its backend (`make_backend`), and torch.distributed in the
# methods that use it.
if TYPE_CHECKING:
    import torch.distributed as dist

    from elasticmoe.engine.handover import RequestSnapshot
    from hmm.p2p import GroupSpec
    from hmm.providers import Handle
    from imm.native_backend import NativeBackend

logger = logging.getLogger(__name__)


class InstanceRank:
    def __init__(self, rank: int, dp: int, backend: BackendName = "native") -> None:
        self._become(rank, dp, backend)
        if in_ray_actor():  # it maps device memory: exit with the node's raylet (see hmm.lifeline)
            watch_parent()

    def _become(self, rank: int, dp: int, backend: BackendName) -> None:
        self.rank, self.dp = rank, dp
        self.backend = make_backend(backend)
        self.group: dist.ProcessGroup | None = None
        self.has_exported = False
        self.is_shut_down = False
        self.pending_routes = PendingRoutes()  # exported requests awaiting their next rank
        self.streams = RankStreams()  # batched output streams, one per subscriber
        self.engine_id = uuid.uuid4().hex  # see `RankStats.engine_id`

    def reuse(self, rank: int, dp: int, backend: BackendName = "native") -> int:
        """Become rank `rank` of a new dp-`dp` instance in this process, which a retired instance's
        rank left (`imm.rank_processes`): a fresh backend, group, streams and counters. Refused
        (the caller kills the process instead) unless this rank shut down and maps no device memory
        any more, which proves that nothing of its old engine can touch a device again. NOTE: the
        native backend only: vLLM keeps global state per process. Returns the pid."""
        if not self.is_shut_down:
            raise RuntimeError("reuse: this rank has not shut down")
        if backend != "native" or self.backend.name != "native":
            raise RuntimeError(f"reuse: a {self.backend.name} rank's process cannot host a {backend} rank")
        gc.collect()  # the old engine's tensors (and their mappings) go with their last reference
        still_mapped = mapped_segments()
        if still_mapped:
            raise RuntimeError(f"reuse: {len(still_mapped)} device segments are still mapped, e.g. {still_mapped[0]}")
        self._become(rank, dp, backend)
        return os.getpid()

    # ---- standby -----------------------------------------------------------------------

    def node_address(self) -> str:
        return node_address()

    def free_port(self) -> int:
        """A free TCP port on this node (for the EP group's store, which rank 0 hosts)."""
        return free_port("")

    async def init_group(self, spec: GroupSpec, timeout_s: float = 60.0) -> None:
        """Join the instance's EP gloo group as `self.rank`; returns when all `dp` ranks joined.
        A backend whose ranks are independent replicas (vLLM) joins none."""
        if spec.world_size != self.dp:
            raise ValueError(f"group has {spec.world_size} ranks, instance has dp={self.dp}")
        if self.dp == 1 or not self.backend.uses_ep_group:
            return  # ep_size 1: no collectives
        import torch.distributed as dist

        from hmm.p2p import init_gloo

        await asyncio.to_thread(init_gloo, spec, self.rank, node_address(), timeout_s)
        self.group = dist.group.WORLD

    async def build_skeleton(
        self, model_dir: str, engine_options: EngineOptions, seed: Mapping[str, Handle] | None = None
    ) -> float:
        """Standby: whatever the backend prepares before weights are attached (native: config and
        tokenizer; vLLM: its engine, built on `seed`, a replica's handle set). Returns seconds."""
        t0 = time.perf_counter()
        await self.backend.prepare(model_dir, engine_options, self.rank, self.dp, seed)
        return time.perf_counter() - t0

    # ---- attach / warm -----------------------------------------------------------------

    async def attach(
        self, handle_set: Mapping[str, Handle], placement: ExpertPlacement, fence_kv: bool = False
    ) -> AttachResult:
        """Give the engine this rank's device tensors (HMM handles: weights used in place where the
        engine keeps them as given). `fence_kv`: the device's KV pool is still allocated by a
        serving rank (native: hold all its blocks until the first `import_requests`)."""
        return await self.backend.attach(handle_set, placement, self.group, fence_kv)

    def start(self, peers: Sequence[Any] = ()) -> None:
        """Start the step loop. NOTE: every rank of an EP group must be started, or the others hang.
        `peers`: the other ranks of the instance (actor handles), woken through their `wake` when
        this rank gets work while the instance idles (`imm.lockstep_loop`)."""
        if self.has_exported:
            raise RuntimeError("this rank handed its requests over; its engine must not run again")
        self.backend.start(functools.partial(_wake_all, list(peers)) if peers else None)

    def wake(self) -> None:
        """A peer rank has work: join the next round of the step loop now."""
        self.backend.wake()

    async def warm_up(self, max_tokens: int = 2) -> float:
        """Send one short greedy request through the running loop; returns its latency in seconds
        (a native rank with a fenced KV pool sends none, see `NativeBackend.warm_up`)."""
        t0 = time.perf_counter()
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        await self.backend.warm_up(EngineRequest(f"warmup-{self.rank}-{time.monotonic_ns()}", [1, 2, 3], params))
        # The engine and what its first step made live as long as it serves: out of the full passes
        # of the garbage collector until `shutdown` (elasticmoe.utils.gc_heap)
        freeze_startup_heap(f"rank {self.rank}")
        return time.perf_counter() - t0

    async def stop(self) -> None:
        """Stop the loop at a step boundary; the other ranks stop in the same round."""
        await self.backend.stop()

    # ---- serving -----------------------------------------------------------------------

    async def _items(self, request: EngineRequest) -> AsyncGenerator[OutputDelta | HandedOverOutput, None]:
        """One request's stream: its `OutputDelta`s; the last is finished, or a `HandedOverOutput`
        naming the rank that continues it (`imm.handover`). A request that reached the engine only
        as it paused is turned away unstreamed (`RankPaused`): its caller routes it again.
        NOTE: closing this early aborts the request in the engine."""
        backend = self.backend
        request_id = request.request_id
        try:
            async for out in backend.generate(request):
                yield OutputDelta.of(out)
        except HandedOver:
            yield HandedOverOutput(request_id, await self.pending_routes.next_rank(request_id))
        except EngineDeadError:
            # NOTE: Ray may start this after a concurrent `pause` although it was sent first;
            # the request then never reached the engine (or was failed unexported by
            # `hand_over_streams`) and nothing was streamed: send it elsewhere, do not fail it.
            if backend.is_pausing:
                raise RankPaused(request_id) from None
            raise

    async def _resumed_items(self, request_id: str) -> AsyncGenerator[OutputDelta | HandedOverOutput, None]:
        """The rest of an imported request: the first delta follows the last one the old rank
        sent; the last is finished, or a marker when it moved on again (a second scale)."""
        try:
            async for out in self.backend.resume(request_id):
                yield OutputDelta.of(out)
        except HandedOver:
            yield HandedOverOutput(request_id, await self.pending_routes.next_rank(request_id))

    def _check_accepting(self, request_id: str) -> None:
        if not self.backend.is_started:
            raise RuntimeError("the step loop is not started")
        if self.backend.is_pausing or self.has_exported:
            raise RankPaused(request_id)

    # ---- serving: batched, one stream per subscriber ------------------------------------

    # NOTE: per-request calls record no Ray task events: the GCS kept them (docs/resilience.md).
    @ray.method(enable_task_events=False)  # type: ignore[call-arg]
    async def submit(self, request: EngineRequest, subscriber: str) -> None:
        """Start `request`; its items go to `subscriber`'s stream (`outputs`). Raises `RankPaused`
        (route it again) if this rank is pausing; an input error arrives as a `StreamFailure`."""
        self._check_accepting(request.request_id)
        self.streams.submit(subscriber, request.request_id, self._items(request))

    @ray.method(enable_task_events=False)  # type: ignore[call-arg]
    async def resume_into(self, request_id: str, subscriber: str) -> None:
        """Continue an imported request into `subscriber`'s stream (after the old rank's marker)."""
        self.streams.submit(subscriber, request_id, self._resumed_items(request_id))

    @ray.method(num_returns="streaming")  # type: ignore[call-arg]
    async def outputs(self, subscriber: str) -> AsyncGenerator[list, None]:
        """`subscriber`'s items as lists (`OutputDelta`, `HandedOverOutput`, `StreamFailure`), each
        everything produced since the previous one; ends once it has had no request here for a
        while (it subscribes again with its next request, nothing is lost)."""
        async for batch in self.streams.stream(subscriber):
            yield batch

    # ---- serving: one Ray stream per request ----------------------------------------------

    @ray.method(num_returns="streaming", enable_task_events=False)  # type: ignore[call-arg]
    async def generate(self, request: EngineRequest) -> AsyncGenerator[OutputDelta | HandedOverOutput, None]:
        """Stream this request's items (see `_items`). Input errors raise before anything is
        yielded. NOTE: cancelling the Ray generator aborts the request in the engine."""
        self._check_accepting(request.request_id)
        async for item in self._items(request):
            yield item

    @ray.method(num_returns="streaming", enable_task_events=False)  # type: ignore[call-arg]
    async def resume(self, request_id: str) -> AsyncGenerator[OutputDelta | HandedOverOutput, None]:
        """Stream the rest of an imported request (see `_resumed_items`)."""
        async for item in self._resumed_items(request_id):
            yield item

    # ---- ESFT and LoRA adapters (native backend only; the coordinator drives every rank) ----

    def _native_or_none(self) -> NativeBackend | None:
        return cast("NativeBackend", self.backend) if self.backend.name == "native" else None

    def _native(self) -> NativeBackend:
        native = self._native_or_none()
        if native is None:
            raise RuntimeError(f"adapters need the native backend; this rank runs {self.backend.name}")
        return native

    async def load_esft_adapter(
        self, name: str, slot: int, experts: dict[int, tuple[int, ...]], pages: dict[str, list[SlotPages]] | None,
        usage_probability: float | None = None,
    ) -> int:
        """Route adapter `name` (slot `slot`) to its expert rows, which the HMM has mapped and
        filled on this rank's device: `pages` are rows mapped after this engine attached (this
        view maps them first); None: rows already in the handle set the engine attached to."""
        return await self._native().load_esft_adapter(name, slot, experts, pages, usage_probability)

    async def load_lora_adapter(self, name: str, path: str, usage_probability: float | None = None) -> int | None:
        """Load a PEFT LoRA adapter from `path` (this rank keeps its own experts' factors)."""
        return await self._native().load_lora_adapter(name, path, usage_probability)

    async def load_lora_router(self, name: str, router: Any, usage_probability: float | None = None) -> None:
        """Register a learned LoRA router (MoLoRA §4.3) over this engine's loaded LoRA adapters."""
        await self._native().load_lora_router(name, router, usage_probability)

    async def unload_adapter(self, name: str) -> bool:
        """Stop admitting requests for `name` (see `LLMEngine.unload_adapter`)."""
        return await self._native().unload_adapter(name)

    async def adapter_in_use(self, name: str) -> bool:
        return await self._native().adapter_in_use(name)

    async def adapter_admitted(self, name: str) -> int:
        """Requests this rank admitted for `name` since it loaded it."""
        return await self._native().adapter_admitted(name)

    async def finish_adapter_unload(self, name: str, rows: dict[str, list[int]]) -> None:
        """Release `name` in the engine (if still there, unload requested or not: this also undoes a
        load that failed on another rank) and unmap its `rows` from this view; the HMM then
        returns their pages to the pool."""
        await self._native().finish_adapter_unload(name, rows)

    def served_adapters(self) -> tuple[str, ...]:
        native = self._native_or_none()
        return native.served_adapters() if native is not None else ()

    # ---- expert load and offloading (native backend only) ----------------------------------

    def expert_load(self) -> np.ndarray | None:
        """Tokens this rank routed per (MoE layer, expert) (None: no native engine)."""
        native = self._native_or_none()
        return native.expert_load() if native is not None else None

    async def warm_expert_cache(self, popularity: np.ndarray) -> int:
        """Fill this rank's expert cache with its most used experts by `popularity` (before it
        serves); returns the rows filled."""
        return await self._native().warm_expert_cache(popularity)

    # ---- switchover ----------------------------------------------------------------------

    async def pause(self) -> None:
        """Stop the loop at a round boundary, agreed by every rank of the group; the
        streams stay open (see `export_requests`). Returns once this rank's loop ended."""
        await asyncio.to_thread(self.backend.pause)

    async def export_requests(self, hand_over_kv: bool) -> list[RequestSnapshot]:
        """After `pause`: remove every live request (late adds included) and return its snapshot;
        each request's stream then waits for `route_handed_over` and ends with a `HandedOverOutput`.

        `hand_over_kv`: the block tables travel and stay allocated for the pool's next owner
        (native; a vLLM replica's requests are always recomputed where they go).
        NOTE: runs on the actor's event loop without awaiting, so no `generate` or `abort`
        interleaves with it; the engine must never step again (`start` refuses).
        """
        snaps = self.backend.export_requests(hand_over_kv)
        self.has_exported = True
        ids = [s.request_id for s in snaps]
        self.pending_routes.expect(ids)  # NOTE: before the streams learn they were handed over
        self.backend.hand_over_streams(ids)
        return snaps

    def route_handed_over(self, routes: Mapping[str, Any]) -> int:
        """The switchover placed exported requests (request id -> the `InstanceRank` actor that
        continues each); their streams here end with a marker naming it. Routes of requests
        exported elsewhere are ignored. Returns how many streams of this rank were routed."""
        return self.pending_routes.publish(routes)

    def abandon_handover(self, reason: str) -> None:
        """No route will come for the exported requests still waiting here: their streams fail,
        and each consumer continues its request from what its client received."""
        self.pending_routes.abandon(reason)

    async def wait_resumed(self, request_ids: list[str], timeout_s: float) -> list[str]:
        """Wait until the imported `request_ids` were resumed here (their consumers read the old
        rank's markers, so every output before them arrived); returns those still unresumed."""
        deadline = time.monotonic() + timeout_s
        while True:
            missing = self.backend.unresumed(request_ids)
            if not missing or time.monotonic() >= deadline:
                return missing
            await asyncio.sleep(0.01)

    async def import_requests(self, snaps: list[RequestSnapshot], kv_is_shared: bool) -> ImportReport:
        """Continue exported requests here; read each one with `resume(request_id)`.

        `kv_is_shared`: this rank's pool is the exporter's (same device): block tables are
        claimed, nothing is recomputed (native). The first import releases a native `KVFence`.
        NOTE: call only after every old rank on this rank's device exported.
        """
        computed = await self.backend.import_requests(snaps, kv_is_shared)
        return ImportReport(self.rank, kv_is_shared, len(snaps), computed)

    async def reinstate(self, snaps: list[RequestSnapshot], kv_kept: bool) -> int:
        """Undo this rank's pause and export (a switchover that rolled back): run the loop again
        and take the exported requests back; read each with `resume(request_id)`. `kv_kept`: they
        were exported with `hand_over_kv`, so their blocks never left this pool (no recompute).
        NOTE: every rank of the instance must reinstate (lockstep), and the instance they were
        handed to must be retired first (it shares the pool)."""
        if snaps and not self.has_exported:
            raise RuntimeError("reinstate: these requests were never exported here")
        await self.backend.reinstate(snaps, kv_kept)
        self.has_exported = False
        return len(snaps)

    @ray.method(enable_task_events=False)  # type: ignore[call-arg]
    async def abort(self, request_id: str) -> None:
        """Abort; its KV blocks are freed. A batched request's pump stops (nothing more is sent for
        it); a per-request stream ends with `finish_reason="abort"`."""
        if not await self.streams.cancel(request_id):
            await self.backend.abort(request_id)

    def stats(self) -> RankStats:
        return rank_stats(self.rank, self.engine_id, self.backend.counters())

    def pid(self) -> int:
        """This rank's process (operators and chaos tests kill it by this)."""
        return os.getpid()

    def where(self) -> dict[str, Any]:
        """This rank's process and the Ray node it runs on."""
        return {"pid": os.getpid(), "ray_node_id": ray_node_id()}

    def frozen_objects(self) -> int:
        """The objects this process keeps out of the garbage collector's full passes: its startup
        heap once warm, none once shut down (`elasticmoe.utils.gc_heap`)."""
        return gc.get_freeze_count()

    def max_model_len(self) -> int:
        """The attached engine's context limit (the KV pool may lower the model's)."""
        return self.backend.max_model_len

    def check_health(self) -> bool:
        """Raise `EngineDeadError` unless the loop runs and ticks (or is paused for a switchover,
        on purpose); True otherwise."""
        if not self.backend.is_started:
            raise RuntimeError("the step loop is not started")
        if self.backend.is_paused or self.has_exported:  # a paused loop ended cleanly (a crash is not a pause)
            return True
        self.backend.check_health()
        return True

    async def shutdown(self) -> None:
        """Stop the loop, drop the engine (unmaps the handles), leave the group and end the
        subscriptions (their subscribers learn at once). Idempotent."""
        thaw_heap()  # the engine's cycles (and the device tensors they map) must be collectable now
        await self.backend.shutdown()
        if self.group is not None:
            import torch.distributed as dist

            if dist.is_initialized():
                dist.destroy_process_group()
        self.group = None
        self.streams.close()
        self.is_shut_down = True


def _wake_all(peers: Sequence[Any]) -> None:
    for peer in peers:
        peer.wake.remote()  # fire and forget: a lost wake costs one idle wait


InstanceRankActor = ray.remote(num_cpus=0)(InstanceRank)
