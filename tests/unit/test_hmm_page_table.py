"""Pure page bookkeeping: slot geometry, page allocator ref counts, sub-page
sharing — including the DeepSeek-V2-Lite arithmetic for the real ESFT configs,
checked without allocating any memory."""

from __future__ import annotations

import math

import pytest

from hmm.memory import MemoryAccount, OutOfDeviceMemory, PageAllocator, PageTable, SlotLayout, pages_needed
from hmm.memory.fragmentation import (
    DEEPSEEK_V2_LITE,
    adapter_slot_ids,
    load_esft_configs,
    moe_layers,
    smallest_e_max,
)

ESFT_DIR = "/work/shared/data/esft_expert_configs"
MiB = 1024 * 1024
PROJ_BYTES = DEEPSEEK_V2_LITE.expert_bytes // 3  # one of gate/up/down


def test_layout_geometry():
    layout = SlotLayout(num_slots=4, slot_bytes=6, page_size=4)  # 1.5 pages per slot
    assert [list(layout.span(s)) for s in range(4)] == [[0, 1], [1, 2], [3, 4], [4, 5]]
    assert layout.num_vpages == 6 and layout.offset_in_page(1) == 2
    assert not any(layout.owns_whole_pages(s) for s in range(4))
    aligned = SlotLayout.aligned(4, 6, 4)
    assert aligned.stride == 8 and all(aligned.owns_whole_pages(s) for s in range(4))
    exact = SlotLayout(3, 8, 4)
    assert all(exact.owns_whole_pages(s) for s in range(3))
    assert pages_needed(layout, [0, 1]) == 3 and pages_needed(layout, [0, 2]) == 4


def test_allocator_refcounts_and_all_or_nothing():
    acct = MemoryAccount(0, budget=5 * 10)
    alloc = PageAllocator(num_pages=8, page_size=10, account=acct)
    pages = alloc.allocate(3)
    assert pages == [0, 1, 2] and acct.used == 30
    alloc.retain([1])
    assert alloc.release([0, 1]) == [0] and alloc.refcount(1) == 1
    with pytest.raises(OutOfDeviceMemory):
        alloc.allocate(4)  # 2 live + 4 > budget of 5 pages
    assert alloc.num_used == 2 and acct.used == 20
    with pytest.raises(ValueError):
        alloc.retain([0])
    assert alloc.release([1, 2]) == [1, 2] and acct.used == 0
    alloc.check_integrity()


def test_partial_page_is_shared_between_neighbours():
    alloc = PageAllocator(num_pages=16, page_size=4)
    table = PageTable(SlotLayout(num_slots=4, slot_bytes=6, page_size=4))
    assert len(table.map_slot(0, alloc)) == 2
    assert len(table.map_slot(1, alloc)) == 1  # vpage 1 is already there: shared, count 2
    assert alloc.num_used == 3
    assert table.slot_pages(0).page_ids[1] == table.slot_pages(1).page_ids[0]
    assert table.slot_pages(1).offset == 2 and not table.slot_pages(1).whole_pages
    with pytest.raises(ValueError):
        table.map_slot(1, alloc)
    with pytest.raises(ValueError):
        table.swap(0, 1)  # straddling slots cannot be remapped
    table.check_integrity()


def test_unmap_returns_only_unshared_pages():
    alloc = PageAllocator(num_pages=16, page_size=4)
    table = PageTable(SlotLayout(num_slots=4, slot_bytes=6, page_size=4))
    for s in (0, 1):
        alloc_pages = table.map_slot(s, alloc)
        assert alloc_pages
    first = table.slot_pages(0).page_ids
    unbound = table.unmap_slot(0)
    assert unbound == [(0, first[0])]  # vpage 1 stays: slot 1 still covers it
    assert alloc.release([p for _, p in unbound]) == [first[0]]
    unbound = table.unmap_slot(1)
    assert sorted(v for v, _ in unbound) == [1, 2]
    alloc.release([p for _, p in unbound])
    assert alloc.num_used == 0 and table.bound() == {}


def test_source_mapping_needs_whole_pages():
    alloc = PageAllocator(num_pages=16, page_size=4)
    packed = PageTable(SlotLayout(4, 6, 4))
    packed.map_slot(0, alloc)
    aligned = PageTable(SlotLayout.aligned(4, 6, 4))
    with pytest.raises(ValueError):
        aligned.map_slot(2, alloc, packed.slot_pages(0))
    aligned.map_slot(0, alloc)
    other = PageTable(SlotLayout.aligned(4, 6, 4))
    other.map_slot(3, alloc, aligned.slot_pages(0))  # zero-copy share: same pages, one more ref
    assert other.slot_pages(3).page_ids == aligned.slot_pages(0).page_ids
    assert all(alloc.refcount(p) == 2 for p in aligned.slot_pages(0).page_ids)


def _expected_pages(layout: SlotLayout, slot_ids: list[int]) -> int:
    """Independent count: pages touched by the mapped byte ranges (merged runs)."""
    runs: list[list[int]] = []
    for s in sorted(slot_ids):
        start, end = layout.byte_range(s)
        if runs and runs[-1][1] == start:
            runs[-1][1] = end
        else:
            runs.append([start, end])
    total, last_page = 0, -1
    for start, end in runs:
        first, stop = start // layout.page_size, math.ceil(end / layout.page_size)
        total += stop - max(first, last_page + 1)
        last_page = stop - 1
    return total


@pytest.mark.parametrize(
    ("expert_bytes", "page_size"),
    [
        (DEEPSEEK_V2_LITE.expert_bytes, 2 * MiB),  # 8.25 pages per expert: straddles
        (DEEPSEEK_V2_LITE.expert_bytes, MiB // 2),  # 33 pages exactly
        (PROJ_BYTES, 2 * MiB),  # 2.75 pages per projection
        (DEEPSEEK_V2_LITE.expert_bytes, 64 * 1024),
    ],
)
def test_esft_configs_map_exactly_the_needed_pages(expert_bytes: int, page_size: int):
    configs = load_esft_configs(ESFT_DIR)
    assert [c.name for c in configs] == ["intent", "law", "summary", "translation"]
    num_base, e_max = DEEPSEEK_V2_LITE.num_experts, smallest_e_max(configs)
    layout = SlotLayout(num_base + len(configs) * e_max, expert_bytes, page_size)
    # one big "device": the arithmetic only, nothing is allocated
    alloc = PageAllocator(num_pages=len(moe_layers(configs)) * layout.num_vpages, page_size=page_size)
    tables: dict[int, PageTable] = {}
    for layer in moe_layers(configs):
        table = tables[layer] = PageTable(layout)
        slots = list(range(num_base))
        for s in slots:
            table.map_slot(s, alloc)
        for ids in adapter_slot_ids(configs, layer, num_base, e_max):
            for s in ids:
                table.map_slot(s, alloc)
            slots += ids
        bound = table.bound()
        assert len(bound) == _expected_pages(layout, slots) == pages_needed(layout, slots)
        # no page for padding: every bound page holds bytes of a mapped slot
        assert set(bound) == {v for s in slots for v in layout.span(s)}
        needed = len(slots) * expert_bytes
        assert needed <= len(bound) * page_size < needed + 2 * page_size * (1 + len(configs))
        table.check_integrity()
    assert alloc.num_used == sum(len(t.bound()) for t in tables.values())
    if expert_bytes == DEEPSEEK_V2_LITE.expert_bytes and page_size == 2 * MiB:
        assert layout.span(1).start == 8 and layout.offset_in_page(1) == MiB // 2  # 8.25 pages
        assert pages_needed(layout, list(range(num_base))) == 528  # 64 * 8.25
    # unload adapters in a different order than they were loaded, then the base
    for layer, table in tables.items():
        for ids in reversed(adapter_slot_ids(configs, layer, num_base, e_max)):
            for s in ids:
                alloc.release([p for _, p in table.unmap_slot(s)])
        assert len(table.bound()) == pages_needed(layout, list(range(num_base)))
        for s in range(num_base):
            alloc.release([p for _, p in table.unmap_slot(s)])
    assert alloc.num_used == 0 and alloc.num_free == alloc.num_pages
    alloc.check_integrity()
