"""VirtualTensor over a real page pool: remap/move without copies, write-through
to physical pages, zero-copy sharing between tensors, budget errors, and another
process opening the same contiguous tensor."""

from __future__ import annotations

import multiprocessing as mp

import numpy as np
import pytest
import torch

from hmm.memory import (
    MemoryAccount,
    OutOfDeviceMemory,
    PagePool,
    VirtualTensor,
    VirtualTensorHandle,
    open_virtual_tensor,
)

PAGE = 8192
SLOT_SHAPE = (3, 1024)  # float32: 12 KiB = 1.5 pages


@pytest.fixture
def pool(shm_prefix):
    pool = PagePool(MemoryAccount("d0", budget=64 * PAGE), page_size=PAGE, prefix=shm_prefix)
    yield pool
    pool.close()


def _fill(vt: VirtualTensor, slot: int, value: float) -> None:
    vt.map_slot(slot)
    vt.tensor[slot].fill_(value)


def _first_values(vt: VirtualTensor) -> list[float]:
    return [float(vt.tensor[s, 0, 0]) for s in range(vt.num_slots)]


def test_remap_and_move_reorder_without_copy(pool):
    vt = VirtualTensor(pool, 6, SLOT_SHAPE, torch.float32, align_slots=True)
    for s in range(5):
        _fill(vt, s, 10.0 + s)
    ptr, used, pages_0 = vt.tensor.data_ptr(), pool.num_used, vt.slot_pages(0).page_ids
    vt.remap(0, 4)
    vt.move(2, 5)
    vt.remap(1, 3)
    assert _first_values(vt) == [14.0, 13.0, 0.0, 11.0, 10.0, 12.0]
    assert torch.equal(vt.tensor[4], torch.full(SLOT_SHAPE, 10.0))
    assert vt.slot_pages(4).page_ids == pages_0  # the pages moved, the bytes did not
    assert vt.tensor.data_ptr() == ptr and pool.num_used == used  # no buffer, no new pages
    assert not vt.is_mapped(2)
    vt.check_integrity()
    vt.close()
    assert pool.num_used == 0 and pool.account.used == 0
    pool.check_integrity()


def test_packed_slots_share_pages_and_refuse_remap(pool):
    vt = VirtualTensor(pool, 4, SLOT_SHAPE, torch.float32)
    assert vt.tensor.is_contiguous() and vt.tensor.shape == (4, *SLOT_SHAPE)
    _fill(vt, 0, 1.0)
    _fill(vt, 1, 2.0)
    assert pool.num_used == 3  # 2 x 1.5 pages, the middle page shared
    assert not vt.can_remap(0, 1)
    with pytest.raises(ValueError):
        vt.remap(0, 1)
    vt.unmap_slot(0)
    assert pool.num_used == 2 and torch.equal(vt.tensor[1], torch.full(SLOT_SHAPE, 2.0))
    vt.close()
    assert pool.num_used == 0


def test_write_through_to_physical_pages(pool):
    vt = VirtualTensor(pool, 4, SLOT_SHAPE, torch.float32, align_slots=True)
    vt.map_slot(2)
    vt.tensor[2].copy_(torch.arange(3 * 1024, dtype=torch.float32).view(SLOT_SHAPE))
    first, second = vt.slot_pages(2).page_ids
    page = pool.page_view(first).view(torch.float32)
    assert torch.equal(page, torch.arange(PAGE // 4, dtype=torch.float32))
    pool.page_view(second).view(torch.float32)[0] = -5.0  # write to the physical page ...
    assert vt.tensor[2].flatten()[PAGE // 4] == -5.0  # ... seen through the virtual tensor
    vt.close()


def test_shared_pages_between_tensors_outlive_the_old_one(pool):
    old = VirtualTensor(pool, 4, SLOT_SHAPE, torch.float32, align_slots=True)
    for s in range(4):
        _fill(old, s, float(s))
    used = pool.num_used
    # a new layout holding experts 3 and 1 in slots 0 and 1: zero-copy, no new pages
    new = VirtualTensor(pool, 2, SLOT_SHAPE, torch.float32, align_slots=True)
    new.map_slot(0, old.slot_pages(3))
    new.map_slot(1, old.slot_pages(1))
    assert _first_values(new) == [3.0, 1.0] and pool.num_used == used
    old.close()  # "commit": the old mapping goes, shared pages stay
    assert pool.num_used == 4 and _first_values(new) == [3.0, 1.0]
    new.close()
    assert pool.num_used == 0


def test_map_over_budget_changes_nothing(pool):
    vt = VirtualTensor(pool, 64, SLOT_SHAPE, torch.float32, align_slots=True)
    for s in range(32):  # 2 pages each: the whole 64-page budget
        vt.map_slot(s)
    assert not vt.can_map_slot(40)
    with pytest.raises(OutOfDeviceMemory):
        vt.map_slot(40)
    assert not vt.is_mapped(40) and pool.num_used == 64 and pool.account.used == 64 * PAGE
    vt.check_integrity()
    vt.close()


def _open_in_child(conn) -> None:
    handle: VirtualTensorHandle = conn.recv()
    t = open_virtual_tensor(handle)
    conn.send(t.numpy().copy())
    conn.recv()  # NOTE: write only after the owner compared, or it races the comparison
    t[1].fill_(-1.0)  # write into a mapped slot: lands in the owner's page
    conn.send("written")
    conn.close()


def test_other_process_sees_the_same_contiguous_tensor(pool):
    vt = VirtualTensor(pool, 5, SLOT_SHAPE, torch.float32)  # packed: shared pages, slot 3 unmapped
    for s in (0, 1, 2, 4):
        _fill(vt, s, float(s + 1))
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_open_in_child, args=(child,))
    proc.start()
    try:
        parent.send(vt.export())
        assert parent.poll(120), "child did not answer"
        seen = parent.recv()
        assert np.array_equal(seen, vt.tensor.numpy())
        assert (seen[3] == 0).all()  # padding reads as zeros in the other process too
        parent.send("write")
        assert parent.poll(60) and parent.recv() == "written"
        assert torch.equal(vt.tensor[1], torch.full(SLOT_SHAPE, -1.0))
        assert torch.equal(vt.tensor[0], torch.full(SLOT_SHAPE, 1.0))  # neighbours on shared pages intact
    finally:
        proc.join(60)
        if proc.is_alive():
            proc.kill()
        vt.close()
    assert proc.exitcode == 0


def test_the_zero_copy_check_counts_a_stack_with_no_row_mapped_as_holding_nothing(pool):
    """The disk tier's expert stacks map no expert row: their first row is reserved address space,
    neither a copy nor HMM memory. A private tensor is still a copy."""
    from imm.zero_copy import check_zero_copy

    mapped = VirtualTensor(pool, 2, SLOT_SHAPE, torch.float32, align_slots=True)
    mapped.map_slot(0)
    empty = VirtualTensor(pool, 2, SLOT_SHAPE, torch.float32, align_slots=True)
    kv = VirtualTensor(pool, 1, SLOT_SHAPE, torch.float32, align_slots=True)
    kv.map_slot(0)
    weights = {"held": mapped.tensor, "stack": empty.tensor}
    report = check_zero_copy(weights, dict(weights), kv.tensor, 0.0)
    assert report.is_zero_copy and (report.num_shared_mapped, report.num_reserved) == (1, 1)
    private = {**weights, "copied": torch.zeros(4)}
    assert not check_zero_copy(private, dict(weights), kv.tensor, 0.0).is_zero_copy
    for vt in (mapped, empty, kv):
        vt.close()
