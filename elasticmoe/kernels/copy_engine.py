"""A native copy thread (csrc/copy_engine.cpp): queued copies into pool rows that never take the GIL.

The expert cache's prefetches run here (`elasticmoe.engine.expert_copier`): the forward thread
decides and submits, this thread copies. The engine is made with a table of sources (one per
expert): each is up to S segments, a piece of memory or of a file (read with `pread`) written at an
offset of a row of one of the pools, as is or widened from bf16 to fp32. A copy is then two
integers, (source, row). The table holds raw addresses and file descriptors: the caller keeps the
sources, the files open and the pools alive until the engine is closed (`close` waits for the copy
in progress). A file read that fails (an error, or a file cut short) fails its copy:
`take_failed` returns its id, and the copy still counts as finished. An engine made with
`drop_file_pages` drops the pages each file read read from the OS page cache once it has copied them.
"""

from __future__ import annotations

import ctypes
import weakref
from collections.abc import Sequence
from functools import cache

import numpy as np
import numpy.typing as npt
import torch

from elasticmoe.kernels.build import load_kernel

MEMCPY = 0  # count: bytes
BF16_TO_F32 = 1  # count: elements
READ_FILE = 2  # count: bytes; source: a file descriptor, read from the file offset
READ_FILE_BF16_TO_F32 = 3  # count: elements (bf16 in the file)
SEGMENT_FIELDS = 6  # source (address or file descriptor), pool, byte offset in the pool's row, count, kind, file offset
# Which part of its source a copy makes: all of it, or one half of the bytes it writes (split at a
# 64-byte boundary), so that two threads copy one expert together (`CopyEngine.copy_now`).
WHOLE, FIRST_HALF, SECOND_HALF = 0, 1, 2
_HALF_ALIGN = 64  # bytes


def part_bounds(total: int, part: int) -> tuple[int, int]:
    """The bytes [lo, hi) of the `total` a source writes that copy part `part` makes (the rule of
    `CopyEngine::copy` in csrc/copy_engine.cpp, for a copier without the native engine)."""
    middle = total // 2 // _HALF_ALIGN * _HALF_ALIGN
    return {WHOLE: (0, total), FIRST_HALF: (0, middle), SECOND_HALF: (middle, total)}[part]


@cache
def _library() -> ctypes.CDLL | None:
    lib = load_kernel("copy_engine")
    if lib is None:
        return None
    handle, i64, ptr, c_int = ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
    for name, argtypes, restype in (
        ("emoe_copy_engine_new", [ptr, i64, i64, ptr, ptr, i64, i64, i64, i64], handle),
        ("emoe_copy_engine_free", [handle], c_int),
        ("emoe_copy_engine_submit", [handle, ptr, i64], i64),
        ("emoe_copy_engine_cancel", [handle], i64),
        ("emoe_copy_engine_pause", [handle, c_int], c_int),
        ("emoe_copy_engine_finished", [handle], i64),
        ("emoe_copy_engine_running", [handle], i64),
        ("emoe_copy_engine_busy_ns", [handle], i64),
        ("emoe_copy_engine_sleeps", [handle], i64),
        ("emoe_copy_engine_wait", [handle, i64], c_int),
        ("emoe_copy_engine_take_failed", [handle, ptr, i64], i64),
        ("emoe_copy_engine_copy_now", [handle, i64, i64, i64], c_int),
    ):
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = argtypes, restype
    return lib


def available() -> bool:
    return _library() is not None


def _free(lib: ctypes.CDLL, handle: int, memory: object) -> None:
    """Stop the thread (after its copy in progress); `memory` is released only after."""
    lib.emoe_copy_engine_free(handle)


class CopyEngine:
    """One native copy thread. Items get consecutive ids from 0 in submission order; every id below
    `finished()` has been copied or cancelled. Calls are ctypes calls: each releases the GIL."""

    def __init__(self, table: npt.NDArray[np.int64], pools: Sequence[torch.Tensor], keepalive: object = None,
                 poll_us: int = 0, drop_file_pages: bool = False) -> None:
        """`table` [sources, S, 6]: per source, its segments (count 0: padding); `pools`: contiguous
        tensors whose dim 0 indexes rows; `keepalive`: what owns the sources' memory; `poll_us`: how
        long the idle thread polls for new copies (yielding its core) before it sleeps, where a
        core is free for it (see csrc/copy_engine.cpp: waking it from sleep costs the caller);
        `drop_file_pages`: every file read then drops the pages it read from the page cache. The engine
        holds the pools and `keepalive` until its thread has stopped, so that memory cannot be
        freed under a copy, whatever order a collector frees things in."""
        if poll_us < 0:
            raise ValueError(f"copy engine: poll_us must be >= 0, got {poll_us}")
        lib = _library()
        if lib is None:
            raise RuntimeError("copy engine: the native kernel is not available (no C++ compiler, or kernels off)")
        table = np.ascontiguousarray(table, dtype=np.int64)
        if table.ndim != 3 or table.shape[2] != SEGMENT_FIELDS or table.shape[1] < 1:
            raise ValueError(f"copy engine: table must be [sources, S >= 1, {SEGMENT_FIELDS}], got {table.shape}")
        rows = {int(p.shape[0]) for p in pools}
        if not pools or len(rows) != 1 or not all(p.is_contiguous() for p in pools):
            raise ValueError("copy engine: pools must be contiguous tensors with the same number of rows")
        bases = np.array([p.data_ptr() for p in pools], dtype=np.int64)
        row_bytes = np.array([p[0].nbytes for p in pools], dtype=np.int64)
        handle = lib.emoe_copy_engine_new(table.ctypes.data, table.shape[0], table.shape[1], bases.ctypes.data,
                                          row_bytes.ctypes.data, len(pools), rows.pop(), int(poll_us),
                                          int(drop_file_pages))
        if not handle:
            raise ValueError("copy engine: refused: a segment writes outside its pool row, names an unknown pool "
                             "or kind, or a negative file (or its thread could not start)")
        self._lib, self._handle = lib, handle
        self._failed_ids = (ctypes.c_int64 * 64)()  # `take_failed`'s buffer: it runs at every publish
        self.poll_us = int(poll_us)
        self._busy_at_close = 0.0
        self.num_sources = table.shape[0]
        # Freed (its thread joined) at close, garbage collection or interpreter exit, whichever is first:
        # before the memory it copies into can go away.
        self._finalizer = weakref.finalize(self, _free, lib, handle, (tuple(pools), keepalive))

    def submit(self, copies: Sequence[tuple[int, int] | tuple[int, int, int]]) -> int:
        """Queue copies (source, row) or (source, row, part: `WHOLE`, `FIRST_HALF`, `SECOND_HALF`);
        returns the first one's id."""
        self._check_open()
        if any(len(copy) not in (2, 3) for copy in copies):
            raise ValueError(f"copy engine: copies are (source, row[, part]), got {copies}")
        flat = [int(v) for copy in copies for v in (*copy[:2], copy[2] if len(copy) == 3 else WHOLE)]
        first = self._lib.emoe_copy_engine_submit(self._handle, (ctypes.c_int64 * len(flat))(*flat), len(copies))
        if first < 0:
            raise ValueError(f"copy engine: a source, row or part of {copies} is out of range")
        return int(first)

    def copy_now(self, source: int, row: int, part: int = WHOLE) -> bool:
        """Make part `part` of `source` into `row` on this thread (the GIL released), beside the
        engine's thread, which may be copying the other half; False when a file read failed."""
        self._check_open()
        done = int(self._lib.emoe_copy_engine_copy_now(self._handle, source, row, part))
        if done < 0:
            raise ValueError(f"copy engine: source {source}, row {row} or part {part} is out of range")
        return done == 1

    def cancel(self) -> int:
        """Drop every queued item not started; returns the first dropped id (the next id if none)."""
        self._check_open()
        return int(self._lib.emoe_copy_engine_cancel(self._handle))

    def pause(self, paused: bool) -> None:
        """Stop (or resume) taking items; the one in progress completes."""
        self._check_open()
        self._lib.emoe_copy_engine_pause(self._handle, int(paused))

    def finished(self) -> int:
        self._check_open()
        return int(self._lib.emoe_copy_engine_finished(self._handle))

    def running(self) -> int:
        """The id of the item being copied, or -1."""
        self._check_open()
        return int(self._lib.emoe_copy_engine_running(self._handle))

    def wait(self, item: int) -> bool:
        """Block until `item` has finished; False at once if nobody would copy it (queued behind a
        pause, or never submitted)."""
        self._check_open()
        return bool(self._lib.emoe_copy_engine_wait(self._handle, item))

    def take_failed(self) -> list[int]:
        """The ids of copies whose file read failed since the last call (their rows hold garbage).
        Read `finished()` first: every failed id below it is then in the answer."""
        self._check_open()
        out: list[int] = []
        size = len(self._failed_ids)
        while (n := int(self._lib.emoe_copy_engine_take_failed(self._handle, self._failed_ids, size))) > 0:
            out.extend(self._failed_ids[:n])
            if n < size:
                break
        return out

    def sleeps(self) -> int:
        """How many times the idle thread went to sleep (a poll that saw work in time did not)."""
        self._check_open()
        return int(self._lib.emoe_copy_engine_sleeps(self._handle))

    @property
    def busy_s(self) -> float:
        """The thread's time copying so far (its total once closed)."""
        if not self._finalizer.alive:
            return self._busy_at_close
        return self._lib.emoe_copy_engine_busy_ns(self._handle) / 1e9

    @property
    def closed(self) -> bool:
        return not self._finalizer.alive

    def close(self) -> None:
        """Drop the queue, let the copy in progress finish and stop the thread (idempotent)."""
        if not self._finalizer.alive:
            return
        self.cancel()
        running = self.running()
        if running >= 0:
            self.wait(running)
        self._busy_at_close = self.busy_s  # final: nothing copies any more
        self._finalizer()

    def _check_open(self) -> None:
        if not self._finalizer.alive:
            raise RuntimeError("copy engine: closed")
