"""Pure page bookkeeping for virtual tensors: slot geometry, a physical page
allocator with reference counts, and a per-tensor page table.

No memory is touched here, so the arithmetic for real model sizes (DeepSeek-V2-Lite
experts on 2 MiB pages) can be checked without allocating it; `PagePool` and
`VirtualTensor` add the shared file and the `mmap` calls on top.

Sub-page allocation (ExpertWeave §4.2, "Expert-Page Alignment"): slots are packed
back to back, so a slot may start or end inside a page. Such a page is mapped once
and shared by the neighbouring slots (table ref count 2); it goes back to the pool
only when the last slot using it is unmapped. No page is ever mapped for a slot
that is not itself mapped (padding costs address space only).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass

from hmm.memory.accounting import MemoryAccount, OutOfDeviceMemory


@dataclass(frozen=True, slots=True)
class SlotLayout:
    """Geometry of a virtual tensor: `num_slots` slots of `slot_bytes`, slot `s`
    starting at byte `s * stride`, cut into virtual pages of `page_size`."""

    num_slots: int
    slot_bytes: int
    page_size: int
    slot_stride: int = 0  # 0: packed (stride == slot_bytes)

    def __post_init__(self) -> None:
        if self.num_slots <= 0 or self.slot_bytes <= 0 or self.page_size <= 0:
            raise ValueError(f"num_slots, slot_bytes and page_size must be > 0: {self}")
        if self.slot_stride and self.slot_stride < self.slot_bytes:
            raise ValueError(f"slot_stride {self.slot_stride} < slot_bytes {self.slot_bytes}")

    @classmethod
    def aligned(cls, num_slots: int, slot_bytes: int, page_size: int) -> SlotLayout:
        """Every slot starts on a page boundary and owns whole pages (remappable)."""
        return cls(num_slots, slot_bytes, page_size, -(-slot_bytes // page_size) * page_size)

    @property
    def stride(self) -> int:
        return self.slot_stride or self.slot_bytes

    @property
    def num_vpages(self) -> int:
        end = (self.num_slots - 1) * self.stride + self.slot_bytes
        return -(-end // self.page_size)

    @property
    def virtual_bytes(self) -> int:
        return self.num_vpages * self.page_size

    def byte_range(self, slot: int) -> tuple[int, int]:
        if not 0 <= slot < self.num_slots:
            raise IndexError(f"slot {slot} out of range [0, {self.num_slots})")
        start = slot * self.stride
        return start, start + self.slot_bytes

    def span(self, slot: int) -> range:
        """Virtual pages slot `slot` touches (the first/last may be shared)."""
        start, end = self.byte_range(slot)
        return range(start // self.page_size, -(-end // self.page_size))

    def offset_in_page(self, slot: int) -> int:
        return self.byte_range(slot)[0] % self.page_size

    def owns_whole_pages(self, slot: int) -> bool:
        """No other slot's bytes lie in this slot's pages, so its pages can be moved."""
        span = self.span(slot)
        prev_end = self.byte_range(slot - 1)[1] if slot > 0 else 0
        next_start = self.byte_range(slot + 1)[0] if slot + 1 < self.num_slots else None
        return (
            self.offset_in_page(slot) == 0
            and prev_end <= span.start * self.page_size
            and (next_start is None or next_start >= span.stop * self.page_size)
        )


def pages_needed(layout: SlotLayout, slot_ids: Sequence[int]) -> int:
    """Pages mapped when exactly `slot_ids` are mapped: the union of their spans."""
    return len({v for s in slot_ids for v in layout.span(s)})


class PageAllocator:
    """Free list and reference counts of `num_pages` physical pages. Thread-safe.

    Invariants: a page is either free (ref 0, in the free list) or live (ref >= 1);
    each live page is charged `page_size` bytes to `account` (if any) from
    `allocate` until the `release` that drops its count to zero.
    """

    def __init__(self, num_pages: int, page_size: int, account: MemoryAccount | None = None) -> None:
        if num_pages < 0 or page_size <= 0:
            raise ValueError(f"bad pool geometry: {num_pages} pages of {page_size} bytes")
        self.num_pages = num_pages
        self.page_size = page_size
        self.account = account
        self._refs = [0] * num_pages
        self._free = list(range(num_pages - 1, -1, -1))  # pop() hands out the lowest id first
        self._lock = threading.Lock()

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_pages - len(self._free)

    def can_allocate(self, num_pages: int) -> bool:
        fits = self.account is None or self.account.can_allocate(num_pages * self.page_size)
        return num_pages <= len(self._free) and fits

    def allocate(self, num_pages: int) -> list[int]:
        """`num_pages` fresh pages with ref count 1, or `OutOfDeviceMemory` and no change."""
        with self._lock:
            if num_pages > len(self._free):
                device = self.account.device_id if self.account else "?"
                budget = self.num_pages * self.page_size
                raise OutOfDeviceMemory(
                    device, num_pages * self.page_size, self.num_used * self.page_size, budget, "page pool"
                )
            if self.account is not None:
                self.account.reserve(num_pages * self.page_size, what=f"{num_pages} pool pages")
            page_ids = [self._free.pop() for _ in range(num_pages)]
            for p in page_ids:
                self._refs[p] = 1
        return page_ids

    def retain(self, page_ids: Sequence[int]) -> None:
        """One more mapping of each (live) page."""
        with self._lock:
            for p in page_ids:
                if self._refs[p] <= 0:
                    raise ValueError(f"retain of free page {p}")
            for p in page_ids:
                self._refs[p] += 1

    def release(self, page_ids: Sequence[int]) -> list[int]:
        """Drop one reference of each page; return the pages that became free."""
        freed: list[int] = []
        with self._lock:
            for p in page_ids:
                if self._refs[p] <= 0:
                    raise ValueError(f"release of free page {p}")
                self._refs[p] -= 1
                if self._refs[p] == 0:
                    freed.append(p)
            self._on_free(freed)  # before the pages can be handed out again
            self._free.extend(freed)
            if freed and self.account is not None:
                self.account.release(len(freed) * self.page_size)
        return freed

    def _on_free(self, page_ids: list[int]) -> None:
        """Hook for subclasses: the pages just lost their last reference."""

    def refcount(self, page_id: int) -> int:
        return self._refs[page_id]

    def check_integrity(self) -> None:
        free = set(self._free)
        assert len(free) == len(self._free), "page listed free twice"
        for p, r in enumerate(self._refs):
            assert (r == 0) == (p in free), f"page {p}: ref {r}, free={p in free}"


@dataclass(frozen=True, slots=True)
class SlotPages:
    """The physical pages behind one mapped slot, in virtual order; the slot's
    first byte is `offset` bytes into `page_ids[0]`. `whole_pages`: no other slot
    has bytes in these pages, so they may be mapped elsewhere (moved/shared)."""

    slot: int
    offset: int
    page_ids: tuple[int, ...]
    whole_pages: bool


class PageTable:
    """Virtual page -> physical page of one virtual tensor, with per-page slot counts.

    Invariants: a virtual page is bound iff at least one mapped slot covers it, and
    its count is the number of mapped slots covering it (1, or 2 for a page shared
    by packed neighbours). The table holds exactly one `PageAllocator` reference
    per bound virtual page.
    """

    def __init__(self, layout: SlotLayout) -> None:
        self.layout = layout
        self._phys: dict[int, int] = {}
        self._count: dict[int, int] = {}
        self._slots: set[int] = set()

    def is_mapped(self, slot: int) -> bool:
        return slot in self._slots

    def mapped_slots(self) -> list[int]:
        return sorted(self._slots)

    def bound(self) -> dict[int, int]:
        """Copy of vpage -> physical page for every bound virtual page."""
        return dict(self._phys)

    def slot_pages(self, slot: int) -> SlotPages:
        if slot not in self._slots:
            raise KeyError(f"slot {slot} is not mapped")
        span = self.layout.span(slot)
        pages = tuple(self._phys[v] for v in span)
        return SlotPages(slot, self.layout.offset_in_page(slot), pages, self.layout.owns_whole_pages(slot))

    def map_slot(
        self, slot: int, allocator: PageAllocator, source: SlotPages | None = None
    ) -> list[tuple[int, int]]:
        """Bind the pages of `slot`; return the newly bound (vpage, page) pairs to map.

        Without `source`, fresh pages come from `allocator` for the virtual pages
        not already bound by a neighbour. With `source`, the slot is bound to
        existing pages (zero-copy), which needs whole-page slots on both sides.
        Raises (with nothing changed) if the slot is mapped or pages don't fit.
        """
        if slot in self._slots:
            raise ValueError(f"slot {slot} is already mapped")
        span = self.layout.span(slot)
        new_vpages = [v for v in span if v not in self._phys]
        if source is None:
            page_ids = allocator.allocate(len(new_vpages))
        else:
            if not (self.layout.owns_whole_pages(slot) and source.whole_pages):
                raise ValueError(
                    f"slot {slot}: mapping existing pages needs page-aligned slots on both sides"
                )
            if len(source.page_ids) != len(span) or len(new_vpages) != len(span):
                raise ValueError(f"slot {slot}: source has {len(source.page_ids)} pages, span {len(span)}")
            page_ids = list(source.page_ids)
            allocator.retain(page_ids)
        bound = list(zip(new_vpages, page_ids, strict=True))
        self._phys.update(bound)
        for v in span:
            self._count[v] = self._count.get(v, 0) + 1
        self._slots.add(slot)
        return bound

    def unmap_slot(self, slot: int) -> list[tuple[int, int]]:
        """Unbind `slot`; return the (vpage, page) pairs no slot covers any more.

        # NOTE: the caller must unmap those virtual pages *before* releasing the
        # pages to the allocator, or a page could be handed out while mapped here.
        """
        if slot not in self._slots:
            raise KeyError(f"slot {slot} is not mapped")
        unbound: list[tuple[int, int]] = []
        for v in self.layout.span(slot):
            self._count[v] -= 1
            if self._count[v] == 0:
                del self._count[v]
                unbound.append((v, self._phys.pop(v)))
        self._slots.discard(slot)
        return unbound

    def swap(self, slot_a: int, slot_b: int) -> list[tuple[int, int]]:
        """Exchange the pages of two mapped whole-page slots; return (vpage, page) to remap."""
        for s in (slot_a, slot_b):
            if s not in self._slots:
                raise KeyError(f"slot {s} is not mapped")
            if not self.layout.owns_whole_pages(s):
                raise ValueError(
                    f"slot {s} shares pages with a neighbour; only page-aligned slots can be remapped"
                )
        span_a, span_b = self.layout.span(slot_a), self.layout.span(slot_b)
        pages_a = [self._phys[v] for v in span_a]
        pages_b = [self._phys[v] for v in span_b]
        remapped = list(zip(span_a, pages_b, strict=True)) + list(zip(span_b, pages_a, strict=True))
        self._phys.update(remapped)
        return remapped

    def check_integrity(self) -> None:
        expected: dict[int, int] = {}
        for s in self._slots:
            for v in self.layout.span(s):
                expected[v] = expected.get(v, 0) + 1
        assert expected == self._count, f"slot counts {self._count} != {expected}"
        assert set(self._phys) == set(self._count), "bound pages differ from counted pages"
        assert len(set(self._phys.values())) == len(self._phys), "a page is bound at two vpages"
