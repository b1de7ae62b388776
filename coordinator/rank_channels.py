"""The ingress's side of the ranks' batched streams: one subscription per rank, demultiplexed.

Each rank the ingress sends requests to gets a `RankChannel`: one reader task consumes the rank's
stream for this ingress (`InstanceRank.outputs(subscriber)`, lists of items) and puts each item in
its request's queue. A request registers its queue before it is submitted (nothing can arrive
unseen) and unregisters when it ends. If the rank's stream fails (the actor died), every
registered request gets the failure; if it ends because it was idle on the rank's side while a
request was being submitted, it is opened again at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from typing import Any

from elasticmoe.errors import describe_error

logger = logging.getLogger(__name__)


class ChannelClosed(Exception):  # noqa: N818 - delivered in a request's queue, raised by its reader
    """The rank's stream failed under this request (`cause`: what the stream raised)."""

    def __init__(self, cause: BaseException) -> None:
        super().__init__(describe_error(cause))
        self.cause = cause


class RankChannel:
    """The subscription of this ingress to one rank's outputs."""

    def __init__(self, rank: Any, subscriber: str) -> None:
        self.rank, self.subscriber = rank, subscriber
        self.queues: dict[str, asyncio.Queue[Any]] = {}
        self._reader: asyncio.Task[None] | None = None

    def register(self, request_id: str) -> asyncio.Queue[Any]:
        """The queue `request_id`'s items arrive in (register before submitting it)."""
        queue: asyncio.Queue[Any] = asyncio.Queue()
        self.queues[request_id] = queue
        self._ensure_reading()
        return queue

    def unregister(self, request_id: str) -> None:
        self.queues.pop(request_id, None)

    def _ensure_reading(self) -> None:
        if self._reader is None or self._reader.done():
            self._reader = asyncio.create_task(self._read(), name=f"rank-channel-{self.subscriber[:8]}")

    async def _read(self) -> None:
        while self.queues:
            try:
                async for ref in self.rank.outputs.remote(self.subscriber):
                    for item in await ref:
                        queue = self.queues.get(item.request_id)
                        if queue is not None:
                            queue.put_nowait(item)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - the rank or its stream is gone: tell every request
                for queue in list(self.queues.values()):
                    queue.put_nowait(ChannelClosed(exc))
                self.queues.clear()
                return
            # The rank ended an idle subscription; a request registered meanwhile needs a new one.

    async def close(self) -> None:
        if self._reader is not None:
            self._reader.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._reader


class RankChannels:
    """This ingress's channels, by rank actor, with the subscriber id the ranks know it by."""

    def __init__(self, subscriber: str | None = None) -> None:
        self.subscriber = subscriber or f"ingress-{uuid.uuid4().hex[:12]}"
        self._channels: dict[Any, RankChannel] = {}

    def of(self, rank: Any) -> RankChannel:
        """The channel of `rank` (one per rank: two would split its stream between them)."""
        self._forget_idle(but=rank)
        channel = self._channels.get(rank)
        if channel is None:
            channel = self._channels[rank] = RankChannel(rank, self.subscriber)
        return channel

    def _forget_idle(self, but: Any) -> None:
        # Channels of other ranks without a request here (e.g. a retired instance's) are dropped.
        for rank, channel in list(self._channels.items()):
            if rank != but and not channel.queues and (channel._reader is None or channel._reader.done()):
                del self._channels[rank]
