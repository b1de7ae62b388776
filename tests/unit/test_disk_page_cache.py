"""`--expert-page-cache drop`: the disk tier's reads leave none of the experts they read in the OS
page cache (on the forward thread, on the native copy thread and in a load the two share), so the
experts take no memory beyond the cache's rows and every miss reads the disk; `keep` (the default)
leaves the pages cached. Residency is asked of the kernel (`mincore` over a mapping of the file)."""

from __future__ import annotations

import ctypes
import mmap
import os
from pathlib import Path

import pytest
import torch
from offload_factories import bf16_disk_experts

from elasticmoe.engine.expert_copier import NativeCopier, make_copier
from elasticmoe.engine.expert_sources import DiskExperts, LayerExpertSpecs
from elasticmoe.kernels import copy_engine
from elasticmoe.kernels.copy_engine import FIRST_HALF, SECOND_HALF

PAGE = mmap.PAGESIZE
ROWS, COLS = 64, 256  # one bf16 part: 32 KiB, eight pages
NUM_EXPERTS = 3

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_libc.mmap.restype = ctypes.c_void_p
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]

needs_copy_engine = pytest.mark.skipif(not copy_engine.available(), reason="no C++ compiler for the copy engine")


def resident_pages(path: Path) -> set[int]:
    """The indexes of `path`'s pages that are in the page cache (mapping a file reads none of it)."""
    size = path.stat().st_size
    fd = os.open(path, os.O_RDONLY)
    try:
        address = _libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        if address in (None, ctypes.c_void_p(-1).value):
            raise OSError(ctypes.get_errno(), "mmap")
        try:
            pages = (size + PAGE - 1) // PAGE
            vec = (ctypes.c_ubyte * pages)()
            if _libc.mincore(address, size, vec) != 0:
                raise OSError(ctypes.get_errno(), "mincore")
            return {i for i in range(pages) if vec[i] & 1}
        finally:
            _libc.munmap(address, size)
    finally:
        os.close(fd)


def pages_of(disk: DiskExperts, local: int) -> set[int]:
    """The file pages expert `local` of layer 0 lies in."""
    parts = [*disk._parts[0][0][local], *disk._parts[0][1][local]]
    return {p for part in parts for p in range(part.offset // PAGE, (part.offset + part.numel * 2 - 1) // PAGE + 1)}


@pytest.fixture
def checkpoint(tmp_path: Path) -> tuple[Path, list[LayerExpertSpecs]]:
    """Three bf16 experts of one layer, written, synced and then dropped from the page cache (a
    dirty page cannot be dropped); skipped where the file system keeps them anyway (tmpfs)."""
    _, _, w13, w2 = bf16_disk_experts(tmp_path, NUM_EXPERTS, (ROWS, COLS))
    path = tmp_path / "model.safetensors"
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
    if resident_pages(path):
        pytest.skip("this file system keeps a file's pages in memory (tmpfs?): nothing to drop")
    return path, [LayerExpertSpecs(w13, w2)]


def rows(n: int = NUM_EXPERTS) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.zeros(n, 2 * ROWS, COLS), torch.zeros(n, ROWS, COLS)


def test_keep_leaves_what_the_forward_thread_read_cached_and_drop_leaves_nothing(checkpoint):
    path, layers = checkpoint
    dropped = DiskExperts(str(path.parent), layers, drop_pages=True)
    w13, w2 = rows()
    for local in (0, 1):
        assert dropped.copy_into(0, local, w13[local], w2[local]) == w13[local].nbytes + w2[local].nbytes
    assert not resident_pages(path)
    # The last expert, so that the kernel's readahead for this read runs past the end of the file
    # and not into the experts read above.
    kept = DiskExperts(str(path.parent), layers)
    kept.copy_into(0, 2, w13[2], w2[2])
    assert pages_of(kept, 2) <= resident_pages(path)
    want13, want2 = rows()
    for local in range(NUM_EXPERTS):  # the same bytes either way
        kept.copy_into(0, local, want13[local], want2[local])
    assert torch.equal(w13, want13) and torch.equal(w2, want2)


def test_a_dropping_source_drops_what_earlier_reads_left_cached_but_not_mapped_pages(checkpoint):
    """The engine loads its dense weights before it makes the disk tier: those reads (and the
    kernel's readahead around them) leave experts cached, which a dropping source drops at once.
    A page some process maps stays (the kernel keeps it), so weights held through a mapping are safe."""
    path, layers = checkpoint
    path.read_bytes()  # a start that read everything
    DiskExperts(str(path.parent), layers)
    assert len(resident_pages(path)) == (path.stat().st_size + PAGE - 1) // PAGE  # keep: all still cached
    with open(path, "rb") as f, mmap.mmap(f.fileno(), PAGE, prot=mmap.PROT_READ) as mapped:
        assert mapped[:8] == path.read_bytes()[:8]  # the first page (the whole mapping) touched
        DiskExperts(str(path.parent), layers, drop_pages=True)
        assert resident_pages(path) == {0}
    DiskExperts(str(path.parent), layers, drop_pages=True)
    assert not resident_pages(path)


@needs_copy_engine
def test_the_native_copier_drops_what_it_read_in_prefetches_and_in_a_shared_load(checkpoint):
    path, layers = checkpoint
    disk = DiskExperts(str(path.parent), layers, drop_pages=True)
    pool13, pool2 = rows()
    copier = make_copier(disk, pool13, pool2, num_layers=1, num_local=NUM_EXPERTS)
    assert isinstance(copier, NativeCopier)
    try:
        first = copier.submit([(0, 0, 0), (0, 1, 1)])  # prefetches: the copy thread reads
        assert copier.wait(first + 1) and not copier.failed
        second = copier.submit_second_half((0, 2, 2))  # a load shared by both threads
        assert copier.copy_now((0, 2, 2), FIRST_HALF) and copier.wait(second)
        assert not resident_pages(path)
        want13, want2 = rows()
        for local in range(NUM_EXPERTS):
            disk.copy_into(0, local, want13[local], want2[local])
        assert torch.equal(pool13, want13) and torch.equal(pool2, want2)
    finally:
        copier.close()


@needs_copy_engine
def test_a_prefetch_whose_second_half_cannot_be_read_fails_whole(checkpoint):
    """A dropping engine makes a whole copy on two threads, a half each (the disk serves two reads
    at once faster than one): the helper's half failing fails the copy, and the next one is whole."""
    path, layers = checkpoint
    disk = DiskExperts(str(path.parent), layers, drop_pages=True)
    pool13, pool2 = rows()
    copier = make_copier(disk, pool13, pool2, num_layers=1, num_local=NUM_EXPERTS)
    try:
        # The file ends 64 bytes before the last expert's `up` does: the second half of its w13 row
        # ([gate; up]) cannot be read; its first half (gate, up's first half) and its w2 (`down`,
        # stored first: safetensors sorts the names) can.
        up = disk._parts[0][0][NUM_EXPERTS - 1][1]
        os.truncate(path, up.offset + up.numel * 2 - 64)
        first = copier.submit([(0, NUM_EXPERTS - 1, 0), (0, 0, 1)])
        assert copier.wait(first + 1)
        assert copier.finished() == first + 2 and copier.failed == {first}
        want13, want2 = rows(1)
        disk.copy_into(0, 0, want13[0], want2[0])
        assert torch.equal(pool13[1], want13[0]) and torch.equal(pool2[1], want2[0])
    finally:
        copier.close()


@needs_copy_engine
def test_a_native_copier_over_a_keeping_source_leaves_its_reads_cached(checkpoint):
    path, layers = checkpoint
    disk = DiskExperts(str(path.parent), layers)
    pool13, pool2 = rows()
    copier = make_copier(disk, pool13, pool2, num_layers=1, num_local=NUM_EXPERTS)
    try:
        assert copier.copy_now((0, 1, 0), SECOND_HALF)
        first = copier.submit([(0, 0, 1)])
        assert copier.wait(first)
        assert pages_of(disk, 0) <= resident_pages(path)
    finally:
        copier.close()


def test_a_drop_the_kernel_refuses_leaves_the_pages_cached_and_the_read_good(checkpoint, monkeypatch):
    path, layers = checkpoint
    disk = DiskExperts(str(path.parent), layers, drop_pages=True)

    def refused(fd: int, offset: int, length: int, advice: int) -> None:
        raise OSError(22, "Invalid argument")

    monkeypatch.setattr(os, "posix_fadvise", refused)
    w13, w2 = rows(2)
    disk.copy_into(0, 1, w13[0], w2[0])
    assert pages_of(disk, 1) <= resident_pages(path)
    monkeypatch.undo()
    DiskExperts(str(path.parent), layers).copy_into(0, 1, w13[1], w2[1])
    assert torch.equal(w13[0], w13[1]) and torch.equal(w2[0], w2[1])
