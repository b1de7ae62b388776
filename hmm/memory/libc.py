"""Thin ctypes bindings to the libc calls Python's `mmap` module lacks.

Python's `mmap.mmap` cannot map at a fixed address, and it cannot punch holes in
a file. The virtual tensors need both: reserve a range once, then place pages of a
shared file at fixed offsets inside it (`MAP_FIXED`), and give a freed page's
memory back to the kernel (`fallocate(PUNCH_HOLE)`). A KV pool is faulted in ahead
of its first writes (`madvise(MADV_POPULATE_WRITE)`).

Every wrapper raises `OSError` with the C errno on failure; none returns an error
code.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import mmap
import os

PROT_NONE = 0x0
PROT_READ = mmap.PROT_READ
PROT_WRITE = mmap.PROT_WRITE
MAP_SHARED = mmap.MAP_SHARED
MAP_PRIVATE = mmap.MAP_PRIVATE
MAP_ANONYMOUS = mmap.MAP_ANONYMOUS
MAP_FIXED = 0x10
MAP_NORESERVE = getattr(mmap, "MAP_NORESERVE", 0x4000)
FALLOC_FL_KEEP_SIZE = 0x01
FALLOC_FL_PUNCH_HOLE = 0x02
MADV_POPULATE_WRITE = 23  # Linux >= 5.14
PAGE_SIZE = mmap.PAGESIZE  # the OS page size; every offset we map at is a multiple of it

_MAP_FAILED = ctypes.c_void_p(-1).value

_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [
    ctypes.c_void_p,
    ctypes.c_size_t,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_long,
]
_libc.munmap.restype = ctypes.c_int
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.fallocate.restype = ctypes.c_int
_libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_long, ctypes.c_long]
_libc.madvise.restype = ctypes.c_int
_libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]


def _raise_errno(what: str) -> None:
    err = ctypes.get_errno()
    raise OSError(err, f"{what}: {os.strerror(err)}")


def mmap_raw(addr: int | None, length: int, prot: int, flags: int, fd: int = -1, offset: int = 0) -> int:
    """`mmap(2)`; returns the mapped address. With `MAP_FIXED` the result is `addr`."""
    res = _libc.mmap(addr, length, prot, flags, fd, offset)
    if res is None or res == _MAP_FAILED:
        _raise_errno(f"mmap(addr={addr}, length={length}, fd={fd}, offset={offset})")
    return int(res)


def munmap_raw(addr: int, length: int) -> None:
    """`munmap(2)`."""
    if _libc.munmap(addr, length) != 0:
        _raise_errno(f"munmap(addr={addr:#x}, length={length})")


def reserve(length: int, addr: int | None = None) -> int:
    """Reserve `length` bytes of address space backed by nothing.

    The range is readable and reads as zeros (the kernel's shared zero page: no
    memory is charged), and writing to it faults. With `addr`, re-reserves an
    already owned sub-range in place (used to unmap a page without giving the
    address away to another mapping).
    """
    flags = MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE | (MAP_FIXED if addr is not None else 0)
    return mmap_raw(addr, length, PROT_READ, flags)


def map_shared_fixed(addr: int, length: int, fd: int, offset: int) -> None:
    """Map `length` bytes of `fd` at `offset` read-write and shared, at exactly `addr`.

    Replaces whatever was mapped there atomically (no window with a hole).
    """
    mmap_raw(addr, length, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_FIXED, fd, offset)


def punch_hole(fd: int, offset: int, length: int) -> None:
    """Free the memory behind a file range (tmpfs/shm): later reads see zeros."""
    if _libc.fallocate(fd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, offset, length) != 0:
        _raise_errno(f"fallocate(PUNCH_HOLE, offset={offset}, length={length})")


def populate_write(addr: int, length: int) -> None:
    """Fault in the pages of a writable mapping now, as its first writes would, without writing
    (`madvise(MADV_POPULATE_WRITE)`; `addr` page-aligned). A shm page touched for the first time
    is zeroed by the kernel in the faulting thread; done ahead, that work leaves the writer's path.
    Raises `OSError`: EINVAL on kernels before 5.14, ENOMEM for a range not (or no longer) mapped.
    NOTE: ctypes releases the GIL for the call, so a thread may run it beside Python work."""
    if _libc.madvise(addr, length, MADV_POPULATE_WRITE) != 0:
        _raise_errno(f"madvise(POPULATE_WRITE, addr={addr:#x}, length={length})")
