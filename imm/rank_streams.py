"""A rank's outputs to its consumers, batched: one stream per subscriber (an ingress), not per request.

A subscriber submits requests (`submit`) and reads one Ray stream (`InstanceRank.outputs`) whose
items are lists: every delta, handover marker and failure produced for its requests since the
previous item. Per token this costs a few microseconds instead of a Ray stream item per request
(`python -m imm.bench_stream`).

Inside the rank each request is a *pump*: a task that reads the request's items (`OutputDelta`s,
then a `HandedOverOutput` or its end) and puts them in the subscriber's `Outbox`. A pump that
fails puts a `StreamFailure` (the request's exception) instead; `cancel` stops one (its engine
request is aborted, as when a per-request stream is cancelled).

A subscription ends by itself once its subscriber has no request here and nothing arrived for
`idle_s` (a subscriber that went away leaks nothing beyond its requests' remaining outputs); the
subscriber subscribes again when it submits the next one, and nothing put meanwhile is lost.
"""

from __future__ import annotations

import asyncio
import logging
import pickle
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass
from typing import Any

from elasticmoe.errors import describe_error

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class StreamFailure:
    """A request's stream ended with `error` (an input error keeps its `.param`)."""

    request_id: str
    error: BaseException


def portable(exc: BaseException) -> BaseException:
    """`exc` if it survives pickling with its type (ours keep their fields), else a `RuntimeError`
    with its description (a receiver must never fail to unpickle a failure)."""
    try:
        pickle.loads(pickle.dumps(exc))
        return exc
    except Exception:  # noqa: BLE001 - any unpicklable exception
        return RuntimeError(describe_error(exc))


class Outbox:
    """Items for one subscriber, taken as a batch (the rank's event loop)."""

    def __init__(self) -> None:
        self._items: list[Any] = []
        self._ready = asyncio.Event()

    def put(self, item: Any) -> None:
        self._items.append(item)
        self._ready.set()

    def wake(self) -> None:
        self._ready.set()

    def __len__(self) -> int:
        return len(self._items)

    async def take(self, timeout_s: float) -> list[Any]:
        """Everything put since the last take, as soon as there is something (or a wake-up);
        empty after `timeout_s`."""
        if not self._items:
            try:
                await asyncio.wait_for(self._ready.wait(), timeout_s)
            except TimeoutError:
                pass
        self._ready.clear()
        items, self._items = self._items, []
        return items


class RankStreams:
    """The subscribers of one rank: their outboxes and the pumps that fill them."""

    def __init__(self, idle_s: float = 5.0) -> None:
        self.idle_s = idle_s
        self._outboxes: dict[str, Outbox] = {}
        self._pumps: dict[str, tuple[str, asyncio.Task[None]]] = {}  # request id -> (subscriber, pump)
        self._closed = False

    def submit(self, subscriber: str, request_id: str, items: AsyncIterator[Any]) -> None:
        """Pump `items` (one request's) into `subscriber`'s outbox."""
        if request_id in self._pumps:
            raise ValueError(f"request id {request_id!r} is already running")
        outbox = self._outboxes.setdefault(subscriber, Outbox())
        task = asyncio.create_task(self._pump(request_id, outbox, items), name=f"pump-{request_id}")
        self._pumps[request_id] = (subscriber, task)
        task.add_done_callback(lambda _: self._done(request_id, task, outbox))

    def _done(self, request_id: str, task: asyncio.Task[None], outbox: Outbox) -> None:
        if self._pumps.get(request_id, (None, None))[1] is task:
            del self._pumps[request_id]
        outbox.wake()  # its subscription may be idle now

    @staticmethod
    async def _pump(request_id: str, outbox: Outbox, items: AsyncIterator[Any]) -> None:
        try:
            async for item in items:
                outbox.put(item)
        except asyncio.CancelledError:
            raise
        except BaseException as exc:  # noqa: BLE001 - the subscriber gets it, tied to its request
            outbox.put(StreamFailure(request_id, portable(exc)))

    async def cancel(self, request_id: str) -> bool:
        """Stop a request's pump (closing its items aborts the request in the engine); False if
        it has none here."""
        entry = self._pumps.get(request_id)
        if entry is None:
            return False
        task = entry[1]
        task.cancel()
        try:
            await task
        except asyncio.CancelledError:
            pass
        return True

    def close(self) -> None:
        """End every subscription once its outbox is empty (the rank shut down): a subscriber
        reading one learns at once, not after `idle_s`, and subscribes again (to the process's next
        rank, when a retired rank's process is reused: `imm.rank_processes`)."""
        self._closed = True
        for outbox in self._outboxes.values():
            outbox.wake()

    def num_requests(self, subscriber: str) -> int:
        return sum(1 for s, _ in list(self._pumps.values()) if s == subscriber)

    async def stream(self, subscriber: str) -> AsyncGenerator[list[Any], None]:
        """Batches for `subscriber` until it has had no request and no item for `idle_s`."""
        outbox = self._outboxes.setdefault(subscriber, Outbox())
        while True:
            batch = await outbox.take(0 if self._closed else self.idle_s)
            if batch:
                yield batch
            elif self._closed or (not self.num_requests(subscriber) and not len(outbox)):
                # NOTE: a request submitted after this returns lands in a fresh outbox; its
                # subscriber subscribes again (it saw this stream end).
                if self._outboxes.get(subscriber) is outbox:
                    del self._outboxes[subscriber]
                return
