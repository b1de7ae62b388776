"""`VirtualTensor`: a contiguous virtual range whose slots are backed by pool pages.

The range is reserved once (`mmap` of nothing: reads as zeros, writes fault) and
never moves, so the torch tensor over it — shape `[num_slots, *slot_shape]` — is
built once and stays valid. Mapping a slot places pool pages at fixed addresses
inside the range (`MAP_FIXED | MAP_SHARED` from the pool file); remapping a slot
replaces its page table entries (O(pages), no data copy, no new buffer). This is
ElasticMoE's vpage-remap and ExpertWeave's virtual weight tensor: base experts in
slots `[0, M)`, adapter `i` in `[M + i * E_max, M + i * E_max + e_i)`, padding slots
unmapped and free.

Layouts: packed slots (default) waste no memory — a page straddling two slots is
shared (sub-page allocation, see `page_table`) — but only slots that own whole
pages can be moved or shared; `align_slots=True` pads each slot's *address* to a
page boundary (stride > slot size) so every slot can be remapped.

Other processes open an exported `VirtualTensorHandle` and see the same pages at
the same slot offsets. A handle is a snapshot of the page table: after the owner
remaps, readers open a fresh handle (the old one keeps its old pages mapped).
"""

from __future__ import annotations

import ctypes
import math
import os
import threading
import weakref
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from hmm.memory.handle import contiguous_stride, dtype_from_str, dtype_to_str
from hmm.memory.libc import map_shared_fixed, munmap_raw, reserve
from hmm.memory.page_pool import PagePool
from hmm.memory.page_table import PageTable, SlotLayout, SlotPages
from hmm.memory.shm import SHM_DIR


@dataclass(frozen=True, slots=True)
class VirtualTensorHandle:
    """Everything another process needs to rebuild the same virtual tensor:
    the pool file, the geometry and, per mapped slot, its pages and offset."""

    pool_name: str
    page_size: int
    num_slots: int
    slot_shape: tuple[int, ...]
    dtype: str
    slot_stride: int  # bytes between slot starts
    slot_pages: tuple[SlotPages, ...]
    device_id: str = ""

    @property
    def layout(self) -> SlotLayout:
        slot_bytes = math.prod(self.slot_shape) * dtype_from_str(self.dtype).itemsize
        return SlotLayout(self.num_slots, slot_bytes, self.page_size, self.slot_stride)


def _runs(pairs: Sequence[tuple[int, int]]) -> list[tuple[int, int, int]]:
    """(vpage, page) pairs -> (first vpage, first page, count) runs contiguous in both."""
    runs: list[tuple[int, int, int]] = []
    for v, p in sorted(pairs):
        if runs and runs[-1][0] + runs[-1][2] == v and runs[-1][1] + runs[-1][2] == p:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((v, p, 1))
    return runs


def _reserve_tensor(
    layout: SlotLayout, slot_shape: tuple[int, ...], dtype: torch.dtype
) -> tuple[int, torch.Tensor]:
    """Reserve `layout.virtual_bytes` of address space and view it as a tensor.

    The range is unmapped (`munmap`) when the last tensor viewing it is collected,
    so no view can outlive its address range.
    """
    size = layout.virtual_bytes
    addr = reserve(size)
    try:
        region = (ctypes.c_char * size).from_address(addr)  # a buffer over the range; owns nothing
    except BaseException:
        munmap_raw(addr, size)
        raise
    weakref.finalize(region, munmap_raw, addr, size)
    flat = torch.frombuffer(region, dtype=dtype)  # holds `region` until the storage dies
    stride = (layout.stride // dtype.itemsize, *contiguous_stride(slot_shape))
    return addr, flat.as_strided((layout.num_slots, *slot_shape), stride)


class VirtualTensor:
    """`num_slots` slots of `slot_shape`/`dtype` in one contiguous virtual range.

    Invariants: `tensor` (and every view of it) keeps its address for its whole
    life; a slot's pages stay mapped from `map_slot` until `unmap_slot`/`close`;
    reading an unmapped slot gives zeros and writing it faults (SIGSEGV), like an
    unmapped device address. A freshly mapped slot's contents are undefined until
    written (fresh pages are zero, a page shared with a neighbour is not).
    A tensor dropped without `close` keeps its pages charged: views of it may
    still be read, so pages are never released behind the caller's back.
    """

    def __init__(
        self,
        pool: PagePool,
        num_slots: int,
        slot_shape: Sequence[int],
        dtype: torch.dtype,
        *,
        align_slots: bool = False,
    ) -> None:
        self.pool = pool
        self.slot_shape = tuple(int(s) for s in slot_shape)
        self.dtype = dtype
        slot_bytes = math.prod(self.slot_shape) * dtype.itemsize
        make = SlotLayout.aligned if align_slots else SlotLayout
        self.layout = make(num_slots, slot_bytes, pool.page_size)
        self.table = PageTable(self.layout)
        self.addr, self.tensor = _reserve_tensor(self.layout, self.slot_shape, dtype)
        self._lock = threading.Lock()

    @property
    def num_slots(self) -> int:
        return self.layout.num_slots

    @property
    def num_mapped_pages(self) -> int:
        return len(self.table.bound())

    def is_mapped(self, slot: int) -> bool:
        return self.table.is_mapped(slot)

    def slot_pages(self, slot: int) -> SlotPages:
        return self.table.slot_pages(slot)

    def can_map_slot(self, slot: int) -> bool:
        """Fresh pages for `slot` fit in the pool and the device budget."""
        bound = self.table.bound()
        return self.pool.can_allocate(sum(v not in bound for v in self.layout.span(slot)))

    def map_slot(self, slot: int, source: SlotPages | None = None) -> None:
        """Back `slot` with pages: fresh pool pages for the parts no neighbour has
        mapped, or (with `source`, pages of this pool from another slot or tensor)
        the same physical pages — zero-copy. Raises `OutOfDeviceMemory` or
        `ValueError` with nothing changed."""
        with self._lock:
            bound = self.table.map_slot(slot, self.pool, source)
            try:
                self._map(bound)
            except BaseException:
                self._unmap(self.table.unmap_slot(slot))
                raise

    def unmap_slot(self, slot: int) -> None:
        """Unmap `slot`; pages no other slot of this tensor uses are released
        (returned to the pool when no tensor maps them)."""
        with self._lock:
            self._unmap(self.table.unmap_slot(slot))

    def can_remap(self, slot_a: int, slot_b: int) -> bool:
        return self.layout.owns_whole_pages(slot_a) and self.layout.owns_whole_pages(slot_b)

    def remap(self, slot_a: int, slot_b: int) -> None:
        """Swap the contents of two mapped slots by exchanging their pages. O(pages)."""
        with self._lock:
            self._map(self.table.swap(slot_a, slot_b))

    def move(self, src_slot: int, dst_slot: int) -> None:
        """Move a mapped slot to an unmapped one by re-pointing its pages. O(pages)."""
        with self._lock:
            if not self.can_remap(src_slot, dst_slot):
                raise ValueError(
                    f"slots {src_slot}->{dst_slot} share pages with neighbours; use align_slots=True"
                )
            self._map(self.table.map_slot(dst_slot, self.pool, self.table.slot_pages(src_slot)))
            self._unmap(self.table.unmap_slot(src_slot))  # refs 2 -> 1: no page is freed

    def export(self) -> VirtualTensorHandle:
        """A picklable snapshot of the page table (see module docstring)."""
        with self._lock:
            slot_pages = tuple(self.table.slot_pages(s) for s in self.table.mapped_slots())
        return VirtualTensorHandle(
            self.pool.name,
            self.pool.page_size,
            self.num_slots,
            self.slot_shape,
            dtype_to_str(self.dtype),
            self.layout.stride,
            slot_pages,
            self.pool.device_id,
        )

    def close(self) -> None:
        """Unmap every slot. `tensor` stays a valid address range (reads zeros)."""
        for slot in self.table.mapped_slots():
            self.unmap_slot(slot)

    def check_integrity(self) -> None:
        self.table.check_integrity()
        for v, p in self.table.bound().items():
            assert self.pool.refcount(p) >= 1, f"vpage {v} maps free page {p}"

    def _map(self, bound: Sequence[tuple[int, int]]) -> None:
        size = self.pool.page_size
        for v, p, n in _runs(bound):
            map_shared_fixed(self.addr + v * size, n * size, self.pool.fd, p * size)

    def _unmap(self, unbound: Sequence[tuple[int, int]]) -> None:
        size = self.pool.page_size
        for v, _, n in _runs(unbound):
            reserve(n * size, self.addr + v * size)  # keep the address range; drop the pages
        self.pool.release([p for _, p in unbound])


def open_virtual_tensor(handle: VirtualTensorHandle) -> torch.Tensor:
    """Rebuild the tensor of `handle` in this process over the same physical pages.

    The mappings live until the returned tensor and all its views are collected.
    """
    layout = handle.layout
    addr, tensor = _reserve_tensor(layout, handle.slot_shape, dtype_from_str(handle.dtype))
    pairs: dict[int, int] = {}
    for sp in handle.slot_pages:
        pairs.update(zip(layout.span(sp.slot), sp.page_ids, strict=True))
    fd = os.open(os.path.join(SHM_DIR, handle.pool_name), os.O_RDWR)
    try:
        for v, p, n in _runs(list(pairs.items())):
            map_shared_fixed(addr + v * handle.page_size, n * handle.page_size, fd, p * handle.page_size)
    finally:
        os.close(fd)
    return tensor


def map_slot_pages(tensor: torch.Tensor, handle: VirtualTensorHandle, slot_pages: Sequence[SlotPages]) -> None:
    """Map more slots' pages into `tensor`, a view opened from `handle` (same pool and geometry)
    in this process: e.g. an ESFT adapter's experts that the owner mapped after the open.

    NOTE: meant for page-aligned stacks (`align_slots=True`), where a slot owns its pages.
    """
    layout = handle.layout
    pairs: dict[int, int] = {}
    for sp in slot_pages:
        pairs.update(zip(layout.span(sp.slot), sp.page_ids, strict=True))
    addr = tensor.data_ptr()
    fd = os.open(os.path.join(SHM_DIR, handle.pool_name), os.O_RDWR)
    try:
        for v, p, n in _runs(list(pairs.items())):
            map_shared_fixed(addr + v * handle.page_size, n * handle.page_size, fd, p * handle.page_size)
    finally:
        os.close(fd)


def unmap_slot_pages(tensor: torch.Tensor, handle: VirtualTensorHandle, slots: Sequence[int]) -> None:
    """Drop this process's mapping of `slots` in a view opened from `handle` (reads zeros after)."""
    layout, size, addr = handle.layout, handle.page_size, tensor.data_ptr()
    for v, _, n in _runs([(v, v) for slot in slots for v in layout.span(slot)]):
        reserve(n * size, addr + v * size)
