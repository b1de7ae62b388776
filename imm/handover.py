"""Handing running requests from an old instance to a new one (the switchover's critical section).

Splice protocol (one request, old rank A on device d, new instance B):

1. `A.pause()`: A's loop ends at a round boundary (all of A's ranks, same round);
   its consumers keep waiting; nothing is finished or failed.
2. `A.export_requests()`: each live request leaves A's engine as a
   `RequestSnapshot`; its `generate` stream yields the outputs it already produced
   and then waits for the request's next rank (`PendingRoutes`).
3. `B.import_requests(snaps)`: the snapshot goes to B's rank on device d if d is
   kept (`kv_is_shared=True`: the block table is claimed in the same KV pool, no
   recomputation), else to B's least-loaded rank (`kv_is_shared=False`: KV is
   recomputed from the tokens). B's rank buffers the request's outputs from then on.
4. `A.route_handed_over({request_id: B's rank})`: A's stream ends with one
   `HandedOverOutput` marker naming that rank (not a `RequestOutput`, not finished).
5. The consumer, on the marker, calls `resume(request_id)` on the rank it names; that
   stream continues with the next delta: the snapshot carries the emitted token/char
   counts, so deltas neither repeat nor skip. B knows which imported requests were
   resumed (`wait_resumed`), so A is retired only after their consumers read the markers.

The route travels in the stream itself, so the consumer may live in any process (the
ingress) and the switchover needs no channel to it. If no route comes (A's switchover was
abandoned, or A dies first), the stream fails (`HandoverAbandoned`, a rank failure) and the
consumer continues the request from what its client received (`EngineRequest.resume`).

KV pool ownership: on a kept device A's rank and B's rank open the same pool.
B's rank holds a `KVFence` on every block from attach until its first import,
so B never allocates from the pool while A may; A never allocates again after
its export (it is paused, then retired; a paused rank cannot be restarted).
"""

from __future__ import annotations

import asyncio
from collections.abc import Collection, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import ray

from elasticmoe.engine.async_llm import EngineDeadError
from elasticmoe.outputs import OutputAccumulator, RequestOutput

if TYPE_CHECKING:  # the ingress imports the outputs and errors here: it need not load the engine
    from elasticmoe.engine.block_manager import BlockManager
    from elasticmoe.engine.handover import RequestSnapshot


class RankPaused(RuntimeError):
    """`generate` reached a rank that is pausing for a switchover before the request was admitted:
    nothing was streamed, so the caller routes it again (the router's gate holds it until the
    new instance serves)."""

    def __init__(self, request_id: str) -> None:
        super().__init__(f"request {request_id!r} reached a pausing rank; route it again")
        self.request_id = request_id

    def __reduce__(self):
        return (type(self), (self.request_id,))


class HandedOver(Exception):  # noqa: N818 - a control-flow signal, not an error
    """Raised in a consumer's stream when its request was exported at a pause
    (`imm.lockstep_loop`); the rank ends the stream with a `HandedOverOutput`."""

    def __init__(self, request_id: str) -> None:
        super().__init__(request_id)
        self.request_id = request_id


class HandoverAbandoned(EngineDeadError):
    """No rank continues a handed-over request: its stream is lost where it was, so the client's
    side continues it (an `EngineDeadError`: the engine client treats it as a rank failure)."""


@dataclass(frozen=True, slots=True)
class HandedOverOutput:
    """Last item of a `generate`/`resume` stream whose request moved to another rank (not
    finished): `next_rank` (an `InstanceRank` actor) continues it with `resume(request_id)`."""

    request_id: str
    next_rank: Any
    finished: bool = False


@dataclass(frozen=True, slots=True)
class ImportReport:
    rank: int
    kv_is_shared: bool
    num_requests: int
    num_computed_tokens: dict[str, int]  # right after import: > 0 means KV kept, no recompute


class KVFence:
    """Holds every free block of a KV pool shared with a previous owner until the handover.

    Take it on a fresh engine (all blocks free); `release` returns them so that the
    imported block tables can be claimed. Invariant: while fenced, the engine
    allocates nothing from the pool (a request there waits instead).
    """

    def __init__(self, block_manager: BlockManager) -> None:
        self.block_manager = block_manager
        self.block_ids = list(block_manager.free_block_ids)
        if len(self.block_ids) != block_manager.num_blocks:
            raise RuntimeError("kv fence: the pool already has allocated blocks")
        block_manager.claim(self.block_ids)

    def release(self) -> None:
        self.block_manager.release(self.block_ids)
        self.block_ids = []


def assign_snapshots(
    snaps_by_device: Mapping[int, Sequence[RequestSnapshot]],
    device_ids: Sequence[int],
    loads: Sequence[int],
    kv_is_shared: bool = True,
    recompute_devices: Collection[int] = (),
) -> dict[int, tuple[list[RequestSnapshot], list[RequestSnapshot]]]:
    """new rank -> (snapshots continuing on a shared KV pool, snapshots to recompute).

    A request whose KV lives on a device the new instance keeps goes to the rank on that
    device; the others go, one by one, to the rank with the fewest requests (`loads`
    counts the requests a rank already has; ties -> lowest rank). `kv_is_shared=False`
    (the new instance has its own KV pools): every request is recomputed; so are those from
    `recompute_devices` (a device whose pool the new instance does not share: restored after
    its worker died).
    """
    rank_of = (
        {d: r for r, d in enumerate(device_ids) if d not in set(recompute_devices)} if kv_is_shared else {}
    )
    out: dict[int, tuple[list[RequestSnapshot], list[RequestSnapshot]]] = {
        r: ([], []) for r in range(len(device_ids))
    }
    load = list(loads)
    orphans: list[RequestSnapshot] = []
    for device, snaps in snaps_by_device.items():
        if device in rank_of:
            out[rank_of[device]][0].extend(snaps)
            load[rank_of[device]] += len(snaps)
        else:
            orphans.extend(snaps)
    for snap in orphans:
        r = min(range(len(load)), key=lambda i: (load[i], i))
        out[r][1].append(snap)
        load[r] += 1
    return out


class PendingRoutes:
    """A rank's exported requests whose next rank is not known yet (asyncio, the rank's loop).

    `expect` at the export; `publish` (the switchover imported them elsewhere) or `abandon`
    (it never will) settles them; each stream of an exported request awaits `next_rank`."""

    def __init__(self) -> None:
        self._routes: dict[str, asyncio.Future[Any]] = {}
        self._reason = ""

    def expect(self, request_ids: Iterable[str]) -> None:
        loop = asyncio.get_running_loop()
        for request_id in request_ids:
            self._routes[request_id] = loop.create_future()

    def publish(self, routes: Mapping[str, Any]) -> int:
        """Settle the expected requests among `routes` (the others are another rank's); returns how many."""
        settled = 0
        for request_id, rank in routes.items():
            future = self._routes.get(request_id)
            if future is not None and not future.done():
                future.set_result(rank)
                settled += 1
        return settled

    def abandon(self, reason: str) -> None:
        """No route will come for what is still unsettled: those streams fail (`HandoverAbandoned`)."""
        self._reason = reason
        for future in self._routes.values():
            if not future.done():
                future.set_result(None)  # None: abandoned (a result, so nobody has to retrieve an error)

    async def next_rank(self, request_id: str, timeout_s: float = 60.0) -> Any:
        """The rank that continues `request_id`; `HandoverAbandoned` if none comes in `timeout_s`."""
        future = self._routes.get(request_id)
        if future is None:
            raise HandoverAbandoned(f"{request_id!r} was not exported here")
        try:
            rank = await asyncio.wait_for(asyncio.shield(future), timeout_s)
        except TimeoutError:
            raise HandoverAbandoned(f"no handover route for {request_id!r} within {timeout_s:g}s") from None
        finally:
            self._routes.pop(request_id, None)
        if rank is None:
            raise HandoverAbandoned(f"the handover of {request_id!r} was abandoned: {self._reason}")
        return rank


def spliced_stream(
    first: Any, prompt: Sequence[int] = (), timeout_s: float = 60.0
) -> Iterator[RequestOutput | HandedOverOutput]:
    """Iterate a rank's `generate` stream (a Ray ObjectRefGenerator of `OutputDelta`s), following
    handovers.

    Yields a `RequestOutput` per delta (cumulative fields rebuilt from `prompt` and the deltas)
    and each `HandedOverOutput` marker (callers may skip them), so the consumer sees one
    unbroken stream. NOTE: blocks while the switchover is in its critical section; an asyncio
    caller runs this in a thread (or reads the ranks' batched streams, as the ingress does).
    """
    gen = first
    outputs = OutputAccumulator(prompt)
    while True:
        marker: HandedOverOutput | None = None
        for ref in gen:
            item = ray.get(ref, timeout=timeout_s)
            if isinstance(item, HandedOverOutput):
                marker = item
                yield item
            else:
                yield outputs.add(item)
        if marker is None:
            return
        gen = marker.next_rank.resume.remote(marker.request_id)
