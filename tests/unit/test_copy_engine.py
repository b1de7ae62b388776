"""The native copy engine (`elasticmoe.kernels.copy_engine`) and the expert copier built on it:
exact copies and bf16 widening into pool rows, the queue's cancel and pause, refusals of tables and
copies that would write outside a row, and stopping with a copy in progress."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
import weakref

import numpy as np
import pytest
import torch
from offload_factories import bf16_disk_experts

from elasticmoe.engine.expert_copier import NativeCopier, ThreadCopier, make_copier
from elasticmoe.engine.expert_sources import HostExperts
from elasticmoe.kernels import copy_engine
from elasticmoe.kernels.copy_engine import BF16_TO_F32, MEMCPY, READ_FILE_BF16_TO_F32, CopyEngine

pytestmark = pytest.mark.skipif(not copy_engine.available(), reason="no C++ compiler for the copy engine")


def make_engine(sources: list[torch.Tensor], pool: torch.Tensor, poll_us: int = 0) -> CopyEngine:
    """Source i is `sources[i]`, written from the start of a row of `pool` (bf16 sources widened)."""
    table = np.zeros((len(sources), 1, copy_engine.SEGMENT_FIELDS), dtype=np.int64)
    for i, src in enumerate(sources):
        kind, count = (BF16_TO_F32, src.numel()) if src.dtype == torch.bfloat16 else (MEMCPY, src.nbytes)
        table[i, 0] = (src.data_ptr(), 0, 0, count, kind, 0)
    return CopyEngine(table, [pool], poll_us=poll_us)


def test_copies_land_in_their_rows_exactly_and_bf16_widens_exactly():
    gen = torch.Generator().manual_seed(0)
    f32, bf16 = torch.randn(64, generator=gen), torch.randn(64, generator=gen).bfloat16()
    pool = torch.zeros(3, 64)
    engine = make_engine([f32, bf16], pool)
    first = engine.submit([(0, 2), (1, 0)])
    assert engine.wait(first + 1) and engine.finished() == first + 2 and engine.running() == -1
    assert torch.equal(pool[2], f32) and torch.equal(pool[0], bf16.float()) and not pool[1].any()
    assert engine.busy_s > 0
    engine.close()
    assert engine.busy_s > 0  # its total, once closed


def test_cancel_drops_the_copies_not_started_and_their_rows_stay_unwritten():
    src = torch.ones(64)
    pool = torch.zeros(4, 64)
    engine = make_engine([src], pool)
    engine.pause(True)
    first = engine.submit([(0, 0), (0, 1), (0, 2)])
    assert not engine.wait(first)  # queued behind the pause: nobody would copy it
    assert engine.cancel() == first and engine.finished() == first + 3
    assert not pool.any()
    assert engine.cancel() == first + 3  # nothing queued: the next id
    engine.pause(False)
    later = engine.submit([(0, 3)])
    assert later == first + 3 and engine.wait(later) and pool[3].eq(1).all() and not pool[:3].any()
    engine.close()


HOUR_US = 3_600_000_000


@pytest.mark.timeout(120, method="thread")  # a stop that did not end the poll would hang in native code
def test_a_polling_thread_copies_the_same_and_never_sleeps_within_its_poll():
    """Within its poll the idle thread sees submits, a pause and its end without being woken from
    sleep (each wake costs the caller); the copies, cancels and pauses behave as without it."""
    gen = torch.Generator().manual_seed(1)
    sources = [torch.randn(64, generator=gen) for _ in range(3)]
    pool = torch.zeros(3, 64)
    engine = make_engine(sources, pool, poll_us=HOUR_US)
    for i in range(6):  # each submit finds the thread idle: it finished the last one
        copy = engine.submit([(i % 3, (i + 1) % 3)])
        assert engine.wait(copy) and torch.equal(pool[(i + 1) % 3], sources[i % 3])
    engine.pause(True)
    first = engine.submit([(0, 0), (1, 1)])
    assert not engine.wait(first)  # queued behind the pause, while the thread polls on
    assert engine.cancel() == first
    engine.pause(False)
    last = engine.submit([(2, 0)])
    assert engine.wait(last) and torch.equal(pool[0], sources[2])
    assert engine.sleeps() == 0
    engine.close()  # ends the poll: the thread joins now, not in an hour


def test_without_a_poll_the_idle_thread_sleeps():
    pool = torch.zeros(2, 64)
    engine = make_engine([torch.ones(64)], pool)
    assert engine.wait(engine.submit([(0, 1)]))
    engine.pause(True)  # the thread is idle from here on: it sleeps, and this test cannot race it
    deadline = time.monotonic() + 60
    while engine.sleeps() == 0 and time.monotonic() < deadline:
        time.sleep(0.001)
    assert engine.sleeps() >= 1
    engine.close()


def test_refuses_segments_outside_a_row_and_copies_out_of_range():
    pool = torch.zeros(2, 8)
    src = torch.ones(16)
    with pytest.raises(ValueError, match="outside its pool row"):
        make_engine([src], pool)  # 64 bytes into a 32-byte row
    with pytest.raises(ValueError, match="outside its pool row"):
        make_engine([src.bfloat16()], pool)  # 16 elements widen to 64 bytes
    with pytest.raises(ValueError, match="table must be"):
        CopyEngine(np.zeros((1, 1, 4), dtype=np.int64), [pool])
    engine = make_engine([torch.ones(8)], pool)
    for bad in ([(1, 0)], [(0, 2)], [(0, -1)]):
        with pytest.raises(ValueError, match="out of range"):
            engine.submit(bad)
    engine.close()
    with pytest.raises(RuntimeError, match="closed"):
        engine.submit([(0, 0)])


def test_close_waits_for_the_copy_in_progress_and_drops_the_queue():
    """Close never cuts a copy off (every row is whole or untouched, the written ones in submission
    order) and drops what had not started. Whether close lands mid-queue depends on the scheduler (a
    loaded host may run the whole queue before the test thread wakes): an attempt that saw the queue
    run out proves nothing about dropping, so up to five attempts run until one closed mid-queue."""
    src = torch.ones(8 << 20, dtype=torch.uint8).float()  # 32 MiB per copy: still copying at close
    rows = 4
    for _attempt in range(5):
        pool = torch.zeros(rows, src.numel())
        engine = make_engine([src], pool)
        first = engine.submit([(0, row) for row in range(rows)])
        deadline = time.monotonic() + 10
        while engine.running() < 0 and engine.finished() == first and time.monotonic() < deadline:
            time.sleep(0.0005)  # until the thread has started
        engine.close()  # a copy is in progress (the first, unless the thread outran this one)
        engine.close()  # idempotent
        written = [bool(pool[row].eq(1).all()) for row in range(rows)]
        untouched = [not pool[row].any() for row in range(rows)]
        assert all(w or u for w, u in zip(written, untouched, strict=True)), "a copy was cut off"
        assert written[0] and written == sorted(written, reverse=True)  # the first completed; then in order
        if not all(written):
            return  # closed mid-queue: the rest was dropped
    pytest.fail("the queue ran out before close in every attempt")


@pytest.mark.parametrize("sizes", [(300, 5), (5, 300), (1, 1)])  # elements of two segments: a split inside either, or none
def test_the_two_halves_of_a_copy_on_two_threads_make_the_whole(sizes, tmp_path):
    gen = torch.Generator().manual_seed(sum(sizes))
    f32, bf16 = torch.randn(sizes[0], generator=gen), torch.randn(sizes[1], generator=gen).bfloat16()
    path = tmp_path / "parts.bin"
    path.write_bytes(bf16.view(torch.int16).numpy().tobytes())
    fd = os.open(path, os.O_RDONLY)
    try:
        table = np.zeros((2, 2, copy_engine.SEGMENT_FIELDS), dtype=np.int64)
        whole = torch.cat([f32, bf16.float()])
        table[0] = [(f32.data_ptr(), 0, 0, f32.nbytes, MEMCPY, 0), (bf16.data_ptr(), 0, f32.nbytes, bf16.numel(), BF16_TO_F32, 0)]
        table[1] = [(f32.data_ptr(), 0, 0, f32.nbytes, MEMCPY, 0), (fd, 0, f32.nbytes, bf16.numel(), READ_FILE_BF16_TO_F32, 0)]
        pool = torch.zeros(4, whole.numel())
        engine = CopyEngine(table, [pool])
        for source in (0, 1):
            second = engine.submit([(source, source, copy_engine.SECOND_HALF)])
            assert engine.copy_now(source, source, copy_engine.FIRST_HALF)
            assert engine.wait(second)
            assert torch.equal(pool[source], whole), source
        assert engine.wait(engine.submit([(0, 2, copy_engine.FIRST_HALF)]))
        middle = (whole.nbytes // 2 // 64 * 64) // 4  # the first half's values
        assert torch.equal(pool[2, :middle], whole[:middle]) and not pool[2, middle:].any()
        with pytest.raises(ValueError, match="out of range"):
            engine.copy_now(0, 0, 3)  # no such part
        engine.close()
    finally:
        os.close(fd)


def test_an_interpreter_exit_with_copies_in_flight_joins_the_thread_cleanly():
    """A process that exits (or is stopped by SIGTERM's default handler raising SystemExit) while the
    engine copies must not crash in the copy thread: the engine is freed at exit, before the memory."""
    script = textwrap.dedent("""
        import numpy as np, torch
        from elasticmoe.kernels.copy_engine import CopyEngine, MEMCPY
        src = torch.ones(16 << 20)
        pool = torch.zeros(4, src.numel())
        table = np.array([[[src.data_ptr(), 0, 0, src.nbytes, MEMCPY, 0]]], dtype=np.int64)
        engine = CopyEngine(table, [pool])
        engine.submit([(0, r) for r in range(4)] * 8)
        print("submitted", flush=True)
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "submitted" in done.stdout


def test_make_copier_copies_a_bf16_checkpoint_into_fp32_rows_like_copy_into(tmp_path):
    _, disk, _, _ = bf16_disk_experts(tmp_path)
    pool13, pool2 = torch.zeros(3, 6, 4), torch.zeros(3, 3, 4)
    copier = make_copier(disk, pool13, pool2, num_layers=1, num_local=2)
    assert isinstance(copier, NativeCopier)
    first = copier.submit([(0, 1, 2), (0, 0, 0)])
    assert copier.wait(first + 1)
    want13, want2 = torch.empty(6, 4), torch.empty(3, 4)
    disk.copy_into(0, 1, want13, want2)
    assert torch.equal(pool13[2], want13) and torch.equal(pool2[2], want2)
    disk.copy_into(0, 0, want13, want2)
    assert torch.equal(pool13[0], want13) and torch.equal(pool2[0], want2) and not pool13[1].any()
    copier.close()
    # fp32 stacks into bf16 rows: a conversion the engine does not make, so a Python thread copies
    host = HostExperts([(torch.ones(2, 6, 4), torch.ones(2, 3, 4))])
    fallback = make_copier(host, pool13.bfloat16(), pool2.bfloat16(), num_layers=1, num_local=2)
    assert isinstance(fallback, ThreadCopier)
    fallback.close()


def test_the_engine_keeps_its_pools_and_sources_alive_until_its_thread_stops():
    """A collector may free a cache's attributes in any order: the memory the thread writes and reads
    must outlive the thread, whoever drops it first."""
    src, pool = torch.ones(1 << 20), torch.zeros(2, 1 << 20)
    table_owner = [src]
    engine = CopyEngine(np.array([[[src.data_ptr(), 0, 0, src.nbytes, MEMCPY, 0]]], dtype=np.int64), [pool],
                        keepalive=table_owner)
    pool_ref = weakref.ref(pool)
    del src, pool, table_owner
    engine.submit([(0, 0), (0, 1)] * 4)
    assert pool_ref() is not None  # held by the engine, not by the test
    engine.close()
    assert pool_ref() is None  # released once the thread has stopped
