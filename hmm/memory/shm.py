"""CPU device memory: tensors in named shared-memory files under /dev/shm.

One file per allocation. A model's weights are a few hundred tensors per device,
so per-file overhead is negligible, and in exchange `free` gives the memory back
to the kernel at once (no sub-allocator, no segment that stays pinned by one
live tensor) and a handle is simply "file name + view". Many small objects that
need one mapping (KV blocks, expert pages) are sub-allocated by their own managers
(`PagePool`, the KV pool) inside a single allocation instead.

The owner (`ShmBackend`, one per device) creates, exports and frees; any process on
the node opens a handle with `open_tensor`, which maps the same pages
(`MAP_SHARED`, zero-copy). `free` unlinks the file: mappings already open stay
valid until their tensors are dropped, exactly like POSIX shm.
"""

from __future__ import annotations

import logging
import math
import mmap
import os
import threading
import time
import weakref
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from hmm.memory.accounting import MemoryAccount
from hmm.memory.handle import TensorHandle, contiguous_stride, dtype_from_str, dtype_to_str
from hmm.memory.lease import SHM_DIR
from hmm.memory.libc import PAGE_SIZE, populate_write
from hmm.memory.segments import DEFAULT_PREFIX, create_segment, round_up, unlink_segment

logger = logging.getLogger(__name__)


def _view(mm: mmap.mmap | None, handle: TensorHandle) -> torch.Tensor:
    """A tensor over `mm` (which keeps the mapping alive as long as the tensor lives)."""
    dtype = dtype_from_str(handle.dtype)
    if handle.numel == 0 or mm is None:
        return torch.empty(handle.shape, dtype=dtype)
    flat = torch.frombuffer(mm, dtype=dtype, count=handle.nbytes // handle.itemsize, offset=handle.offset)
    return flat.as_strided(handle.shape, handle.stride)


def _map_file(path: str) -> mmap.mmap | None:
    fd = os.open(path, os.O_RDWR)
    try:
        size = os.fstat(fd).st_size
        if size == 0:
            return None
        return mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    finally:
        os.close(fd)  # the mapping keeps the file alive; the fd is not needed


def open_tensor(handle: TensorHandle) -> torch.Tensor:
    """Open `handle` in this process: a tensor over the same physical pages.

    Costs no memory until pages are touched, and touched pages are the owner's
    shared pages (RssShmem), never private copies. The mapping lives until the
    returned tensor and all its views are garbage-collected.
    """
    return _view(_map_file(os.path.join(SHM_DIR, handle.name)), handle)


_PREFAULT_CHUNK = 64 << 20  # bytes per madvise call


def prefault(tensor: torch.Tensor, what: str) -> threading.Thread:
    """Fault in this process's mapping of `tensor` (a writable shm view) on a daemon thread, and
    return it. The thread holds `tensor`, so the mapping outlives every call on it.

    Why: a shm page's first write in a process faults, and the first fault on the page anywhere
    zeroes it (`posix_fallocate` reserves pages on tmpfs without clearing them). A KV pool is
    written a block at a time as requests arrive, so without this its first pass through the pool
    pays those faults inside the forward's KV writes: 5% of both cores in the elastic server's
    rank under load here, for the pool's first GiB. Done ahead, the kernel clears the pages
    beside the engine (the call releases the GIL), at ~0.3 s per GiB. Content is never changed:
    a pool handed over with its KV keeps it. A kernel without `MADV_POPULATE_WRITE` leaves the
    faults where they were (logged)."""
    start = round_up(tensor.data_ptr())  # whole pages inside the tensor only
    end = (tensor.data_ptr() + tensor.numel() * tensor.element_size()) // PAGE_SIZE * PAGE_SIZE

    def run() -> None:
        began = time.monotonic()
        try:
            for addr in range(start, end, _PREFAULT_CHUNK):
                populate_write(addr, min(_PREFAULT_CHUNK, end - addr))
        except OSError as exc:
            logger.info("%s: not faulted in ahead (%s); its first writes fault instead", what, exc)
            return
        logger.info("%s: %.2f GiB faulted in ahead of use in %.2f s",
                    what, max(0, end - start) / (1 << 30), time.monotonic() - began)

    thread = threading.Thread(target=run, name="shm-prefault", daemon=True)
    thread.start()
    return thread


@dataclass(slots=True)
class _Segment:
    name: str
    path: str
    charged: int  # bytes charged to the account
    addr: int
    size: int  # viewed bytes
    base: torch.Tensor  # the owner's contiguous tensor; keeps the mapping alive


def _unlink_all(segments: dict[str, _Segment]) -> None:
    for seg in segments.values():
        unlink_segment(seg.path)
    segments.clear()


class ShmBackend:
    """Allocate/export/free tensors of one device in /dev/shm, charged to `account`.

    Invariants: every live allocation is one file `<prefix>-d<device>-t-...` and its
    rounded-up size is charged to `account`; `free`/`close_all` unlink the file and
    release the charge. Files are also unlinked if the backend is garbage-collected
    or the interpreter exits, so a crashed test leaks nothing.
    """

    def __init__(self, account: MemoryAccount, prefix: str = DEFAULT_PREFIX) -> None:
        self.account = account
        self.prefix = prefix
        self._segments: dict[str, _Segment] = {}
        self._lock = threading.Lock()
        self._finalizer = weakref.finalize(self, _unlink_all, self._segments)

    @property
    def device_id(self) -> str:
        return self.account.device_id

    def can_allocate(self, shape: Sequence[int], dtype: torch.dtype) -> bool:
        return self.account.can_allocate(round_up(math.prod(shape) * dtype.itemsize))

    def allocate(self, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        """A new contiguous tensor (zero-filled) in shareable device memory.

        Raises `OutOfDeviceMemory` if it does not fit; then no file exists and the
        account is unchanged.
        """
        shape = tuple(int(s) for s in shape)
        handle_dtype = dtype_to_str(dtype)
        nbytes = math.prod(shape) * dtype.itemsize
        charged = round_up(nbytes)
        self.account.reserve(charged, what=f"tensor {list(shape)} {handle_dtype}")
        try:
            fd, path, name = create_segment(self.prefix, self.device_id, nbytes)
            try:
                prot = mmap.PROT_READ | mmap.PROT_WRITE
                mm = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED, prot=prot) if nbytes else None
            except BaseException:
                unlink_segment(path)
                raise
            finally:
                os.close(fd)
        except BaseException:
            self.account.release(charged)
            raise
        handle = TensorHandle("shm", name, 0, shape, handle_dtype, contiguous_stride(shape), self.device_id)
        base = _view(mm, handle)
        addr = base.data_ptr() if nbytes else 0
        with self._lock:
            self._segments[name] = _Segment(name, path, charged, addr, nbytes, base)
        return base

    def export(self, tensor: torch.Tensor) -> TensorHandle:
        """The handle of `tensor`, which must be (a view into) an allocation of this backend."""
        seg = self._find(tensor)
        offset = tensor.data_ptr() - seg.addr
        handle = TensorHandle(
            "shm",
            seg.name,
            offset,
            tuple(tensor.shape),
            dtype_to_str(tensor.dtype),
            tuple(tensor.stride()),
            self.device_id,
        )
        if offset + handle.nbytes > seg.size:
            raise ValueError(f"view of {seg.name} extends past the allocation")
        return handle

    def free(self, obj: torch.Tensor | TensorHandle) -> None:
        """Free the allocation holding `obj` (a tensor or handle of it).

        The file is unlinked and the charge released at once; tensors that still
        view it (here or in other processes) stay valid until dropped.
        """
        self._free_name(obj.name if isinstance(obj, TensorHandle) else self._find(obj).name)

    def close_all(self) -> None:
        """Free every allocation of this backend."""
        for name in self.names():
            self._free_name(name)

    def names(self) -> list[str]:
        """Names of live allocations."""
        return sorted(self._segments)

    def _free_name(self, name: str) -> None:
        with self._lock:
            seg = self._segments.pop(name, None)
        if seg is None:
            raise KeyError(f"device {self.device_id}: no live allocation {name}")
        unlink_segment(seg.path)
        self.account.release(seg.charged)

    def _find(self, tensor: torch.Tensor) -> _Segment:
        ptr = tensor.data_ptr()
        with self._lock:
            for seg in self._segments.values():
                if seg.base is tensor or seg.addr <= ptr < seg.addr + seg.size:
                    return seg
        raise KeyError(f"device {self.device_id}: tensor at {ptr:#x} is not an allocation of this backend")
