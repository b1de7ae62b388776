"""The expert cache's prefetch copies, made beside the forward by a copier the cache submits to.

The cache decides on the forward thread which expert goes into which pool row (and which expert
leaves it); a copier only copies, in submission order, like a GPU's copy stream beside its compute
stream. Two copiers with one interface:
- `NativeCopier`: a native thread (`elasticmoe.kernels.copy_engine`) that never takes the GIL. A
  Python copy thread takes the GIL several times per copy, and the forward needs it back after
  every PyTorch op; with the copies decided on the forward and made here, FineMoE's TPOT at 25% of
  the experts fell to ~0.7x (docs/offload.md, "A copy engine beside the forward").
- `ThreadCopier`: a Python thread calling the source's `copy_into`, where the native engine is not
  available (no C++ compiler) or cannot make the copy (a dtype conversion it does not have). Tests
  drive it a copy at a time (`start=False`, `run_one`).

The protocol both keep: copies get consecutive ids from 0; every id below `finished()` has been
copied, failed (in `failed` once `finished()` has passed it) or been cancelled; `cancel()` drops
every copy not started and returns the first dropped id (their rows were never written);
`pause(True)` stops between two copies.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Sequence
from typing import Protocol

import numpy as np
import torch

from elasticmoe.engine.expert_sources import ExpertSource, Segment
from elasticmoe.kernels import copy_engine

logger = logging.getLogger(__name__)

# (MoE layer, local expert index, pool row): one expert copied into one row of the pool
Copy = tuple[int, int, int]


class ExpertCopier(Protocol):
    failed: set[int]  # ids of copies that raised (their rows hold garbage); the cache discards them
    # its thread polls on a core of its own: it may take a share of on-demand loads, down to half of
    # one expert (`submit_second_half` beside `copy_now(copy, FIRST_HALF)`)
    polls: bool

    def submit(self, copies: Sequence[Copy]) -> int: ...  # the first copy's id
    def submit_second_half(self, copy: Copy) -> int: ...  # the copy's id
    # the copy (or its first half) on the caller's thread, the way this copier copies; False: a read failed
    def copy_now(self, copy: Copy, part: int = copy_engine.WHOLE) -> bool: ...
    def cancel(self) -> int: ...
    def pause(self, paused: bool) -> None: ...
    def finished(self) -> int: ...
    def running(self) -> int: ...  # the id being copied, or -1
    def wait(self, copy_id: int) -> bool: ...  # blocks until it finished; False if nobody would copy it
    @property
    def busy_s(self) -> float: ...
    def close(self) -> None: ...


class NativeCopier:
    """Copies by the native copy engine, whose table holds every expert's segments (made once)."""

    def __init__(self, engine: copy_engine.CopyEngine, num_local: int) -> None:
        """`engine`'s source `layer * num_local + local` is that expert."""
        self.engine = engine
        self.failed: set[int] = set()  # copies whose file read failed (the disk tier), as of `finished()`
        self.polls = engine.poll_us > 0
        self._num_local = num_local

    def submit(self, copies: Sequence[Copy]) -> int:
        return self.engine.submit([(layer * self._num_local + local, row) for layer, local, row in copies])

    def submit_second_half(self, copy: Copy) -> int:
        layer, local, row = copy
        return self.engine.submit([(layer * self._num_local + local, row, copy_engine.SECOND_HALF)])

    def copy_now(self, copy: Copy, part: int = copy_engine.WHOLE) -> bool:
        """On the caller's thread by the native copy (the GIL released): for one bf16 expert from
        the page cache ~120 us, against ~210 us through the source's Python `copy_into`."""
        layer, local, row = copy
        return self.engine.copy_now(layer * self._num_local + local, row, part)

    def cancel(self) -> int:
        return self.engine.cancel()

    def pause(self, paused: bool) -> None:
        if not self.engine.closed:  # a closed cache still loads on demand (a step racing a shutdown)
            self.engine.pause(paused)

    def finished(self) -> int:
        finished = self.engine.finished()
        self.failed.update(self.engine.take_failed())  # after: every failed id below `finished` is in
        return finished

    def running(self) -> int:
        return self.engine.running()

    def wait(self, copy_id: int) -> bool:
        return self.engine.wait(copy_id)

    @property
    def busy_s(self) -> float:
        return self.engine.busy_s

    def close(self) -> None:
        self.engine.close()


class ThreadCopier:
    """Copies by `source.copy_into` on a Python thread (or, with `start=False`, by `run_one`)."""

    def __init__(self, source: ExpertSource, w13: torch.Tensor, w2: torch.Tensor, start: bool = True) -> None:
        self.source, self.w13, self.w2 = source, w13, w2
        self.failed: set[int] = set()
        self.polls = False  # a Python thread: it would hold the GIL the forward copies with
        self.busy_s = 0.0
        self._cond = threading.Condition()
        self._queue: deque[tuple[int, Copy, int]] = deque()  # (id, copy, part)
        self._next = self._finished = 0
        self._running = -1
        self._paused = self._closed = False
        self._thread: threading.Thread | None = None
        if start:
            self._thread = threading.Thread(target=self._loop, name="expert-prefetch", daemon=True)
            self._thread.start()

    def submit(self, copies: Sequence[Copy]) -> int:
        return self._enqueue([(copy, copy_engine.WHOLE) for copy in copies])

    def submit_second_half(self, copy: Copy) -> int:
        return self._enqueue([(copy, copy_engine.SECOND_HALF)])

    def copy_now(self, copy: Copy, part: int = copy_engine.WHOLE) -> bool:
        self._copy(copy, part)  # raises where the read fails
        return True

    def _enqueue(self, copies: list[tuple[Copy, int]]) -> int:
        with self._cond:
            first = self._next
            self._queue.extend((first + i, copy, part) for i, (copy, part) in enumerate(copies))
            self._next += len(copies)
            self._cond.notify_all()
            return first

    def _copy(self, copy: Copy, part: int) -> None:
        """`source.copy_into` the row; for a half, the whole expert read aside and that half's bytes
        (`copy_engine.part_bounds` of the bytes the row's w13 then w2 hold) written."""
        layer, local, row = copy
        if part == copy_engine.WHOLE:
            self.source.copy_into(layer, local, self.w13[row], self.w2[row])
            return
        whole13, whole2 = torch.empty_like(self.w13[row]), torch.empty_like(self.w2[row])
        self.source.copy_into(layer, local, whole13, whole2)
        lo, hi = copy_engine.part_bounds(whole13.nbytes + whole2.nbytes, part)
        at = 0
        for dst, src in ((self.w13[row], whole13), (self.w2[row], whole2)):
            dst_bytes, src_bytes = dst.view(-1).view(torch.uint8), src.view(-1).view(torch.uint8)
            first, last = min(max(lo - at, 0), src.nbytes), min(max(hi - at, 0), src.nbytes)
            dst_bytes[first:last].copy_(src_bytes[first:last])
            at += src.nbytes

    def cancel(self) -> int:
        with self._cond:
            first = self._queue[0][0] if self._queue else self._next
            self._queue.clear()
            if self._running < 0:
                self._finished = self._next
            self._cond.notify_all()
            return first

    def pause(self, paused: bool) -> None:
        with self._cond:
            self._paused = paused
            self._cond.notify_all()

    def finished(self) -> int:
        return self._finished

    def running(self) -> int:
        return self._running

    def wait(self, copy_id: int) -> bool:
        with self._cond:
            while copy_id >= self._finished:
                if copy_id >= self._next or self._closed or (self._paused and self._running != copy_id):
                    return False
                self._cond.wait()
            return True

    def run_one(self, block: bool = False) -> bool:
        """Copy the next queued expert; False when there is none (`block`: wait for one, False
        once closed)."""
        with self._cond:
            while self._paused or not self._queue:
                if self._closed or not block:
                    return False
                self._cond.wait()
            copy_id, copy, part = self._queue.popleft()
            self._running = copy_id
        started = time.perf_counter()
        try:
            self._copy(copy, part)
        except Exception:  # noqa: BLE001 - the cache discards the copy; the forward loads on demand
            logger.exception("copy of expert %d/%d failed", copy[0], copy[1])
            self.failed.add(copy_id)
        with self._cond:
            self.busy_s += time.perf_counter() - started
            self._running = -1
            self._finished = self._queue[0][0] if self._queue else self._next
            self._cond.notify_all()
        return True

    def _loop(self) -> None:
        while self.run_one(block=True):
            pass

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._queue.clear()
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=10)


def make_copier(source: ExpertSource, w13: torch.Tensor, w2: torch.Tensor, num_layers: int,
                num_local: int, poll_us: int = 0) -> ExpertCopier:
    """The native copier where the kernel builds and the source can describe every expert's copy;
    else the Python thread. `poll_us`: the native thread's poll before it sleeps (`CopyEngine`)."""
    if not copy_engine.available() or w13.dtype != w2.dtype:
        return ThreadCopier(source, w13, w2)
    pieces: list[list[Segment]] = []
    for layer in range(num_layers):
        for local in range(num_local):
            expert = source.segments(layer, local, w13.dtype)
            if expert is None:
                logger.info("expert prefetch: the source's dtype needs a conversion the native copier does "
                            "not make; a Python thread copies")
                return ThreadCopier(source, w13, w2)
            pieces.append(expert)
    per_copy = max(len(p) for p in pieces)
    table = np.zeros((num_layers * num_local, per_copy, copy_engine.SEGMENT_FIELDS), dtype=np.int64)
    for i, p in enumerate(pieces):
        table[i, : len(p)] = p
    engine = copy_engine.CopyEngine(table, (w13, w2), keepalive=source, poll_us=poll_us,
                                    drop_file_pages=source.drops_pages)
    return NativeCopier(engine, num_local)
