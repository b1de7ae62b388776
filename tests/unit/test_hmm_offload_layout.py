"""Offloading layouts (FineMoE's tiers in the HMM) on the planner's synthetic model: D = 11000 B of
dense tensors, X = 600 B per expert (2 MoE layers of 300 B rows), 32 experts. Here a device has
60000 B and a 30000 B KV pool, so dp 2 holds its 16 experts resident (11000 + 9600 + 30000 =
50600 B) but dp 1 cannot hold all 32 (11000 + 19200 + 30000 = 60200 B). With offloading each device
has an expert cache of half its dp-2 experts, 16 rows of 300 B = 4800 B, and its expert rows are
the host tier: dp 1 charges 11000 + 30000 + 4800 = 45800 B, 50600 B at the peak of the scale (the
old instance's cache and the new one's)."""

from __future__ import annotations

import pytest
from hmm_factories import D, X, make_devices, make_layout, make_sizes

from hmm.layout import Layout, TensorKey, layout_for
from hmm.planner import PlanError, load_plan, plan, restore_plan, scale_target
from hmm.scale_plan import Alloc, DiskLoad, Free, P2PCopy

BUDGET, KV, ROW = 60_000, 30_000, 300
CACHE = 16 * ROW


def _offloading(dp: int, devices: int = 2) -> Layout:
    return layout_for(None, make_sizes(), make_devices(devices, BUDGET), dp, dp, kv_bytes=KV, cache_bytes=CACHE)


def test_cache_pools_are_whole_rows_of_one_layers_expert():
    sizes = make_sizes()
    assert sizes.cache_row_bytes == ROW and sizes.num_moe_layers == 2
    assert sizes.cache_pool_bytes(16, fraction=0.5) == CACHE  # half of 16 experts x 2 layers
    assert sizes.cache_pool_bytes(16, fraction=0.01) == ROW  # rounded up to a row
    assert sizes.cache_pool_bytes(16, budget_bytes=1000) == 3 * ROW  # rounded down to whole rows
    for wrong in ({}, {"budget_bytes": 1000, "fraction": 0.5}):
        with pytest.raises(ValueError, match="exactly one"):
            sizes.cache_pool_bytes(16, **wrong)


def test_an_offloading_device_charges_dense_kv_and_cache_and_holds_experts_as_host_tier():
    with pytest.raises(ValueError, match="exceed its budget"):
        layout_for(None, make_sizes(), make_devices(1, BUDGET), 1, 1, kv_bytes=KV)  # resident: 60200 B
    layout = _offloading(1, devices=1)
    assert layout.offloads and layout.total_bytes(0) == D + KV + CACHE
    assert layout.host_bytes(0) == 32 * X and layout.cache_bytes_of(0) == CACHE
    tensors = layout.tensors(0)
    assert tensors[TensorKey.cache()] == CACHE and tensors[TensorKey.kv()] == KV
    assert not layout.charged(TensorKey.expert_row("layers.0.moe.w13", 0, 5))
    assert layout.charged(TensorKey.cache()) and layout.charged(TensorKey.dense("embed"))
    resident = make_layout(1)
    assert not resident.offloads and resident.host_bytes(0) == 0 and TensorKey.cache() not in resident.tensors(0)
    with pytest.raises(ValueError, match="expert cache"):
        Layout(layout.sizes, layout.devices, layout.placement, layout.kv_bytes, (0,))
    with pytest.raises(ValueError, match="cache key"):
        TensorKey("cache", "kv_pool")


def test_a_scale_down_that_cannot_hold_every_expert_offloads_instead_of_refusing():
    resident = make_layout(2, kv_bytes=KV, budget=BUDGET)
    with pytest.raises(PlanError, match="budget"):
        plan(resident, scale_target(resident, 1))

    p = plan(_offloading(2), scale_target(_offloading(2), 1))
    assert p.target.offloads and p.target.local_experts(0) == tuple(range(32))
    # Device 1's experts reach device 0's host tier by p2p; nothing is read from disk.
    moved = [s for s in p.steps if isinstance(s, P2PCopy)]
    assert {s.key.expert_id for s in moved} == set(range(16, 32)) and all(s.src_device == 1 for s in moved)
    assert not any(isinstance(s, DiskLoad) for s in p.steps)
    # Device 0 gets a new, empty cache for the new instance; the old one is freed at commit.
    cache = [s for s in p.steps if s.key == TensorKey.cache()]
    assert cache == [Alloc(0, TensorKey.cache(), CACHE), Free(0, TensorKey.cache(), CACHE),
                     Free(1, TensorKey.cache(), CACHE)]
    assert p.peak_bytes() == {0: D + KV + 2 * CACHE, 1: D + KV + CACHE}
    assert p.over_budget() == {}


def test_a_scale_up_brings_the_host_tier_back_by_p2p_and_gives_the_new_device_a_cache():
    one = plan(_offloading(2), scale_target(_offloading(2), 1)).target
    devices = make_devices(2, BUDGET)
    p = plan(one, scale_target(one, 2, devices[1:], kv_bytes=KV))
    copies = [s for s in p.steps if isinstance(s, P2PCopy)]
    assert all(s.src_device == 0 and s.dst_device == 1 for s in copies)
    assert {s.key.expert_id for s in copies if s.key.kind == "expert"} == set(p.target.local_experts(1))
    assert Alloc(1, TensorKey.cache(), CACHE) in p.steps and Alloc(0, TensorKey.cache(), CACHE) in p.steps
    assert p.target.total_bytes(1) == D + KV + CACHE and p.target.host_bytes(1) == 16 * X


def test_load_and_restore_allocate_the_cache_and_never_read_it():
    layout = _offloading(2)
    for p in (load_plan(layout), restore_plan(layout, 1)):
        cache_steps = [s for s in p.steps if s.key == TensorKey.cache()]
        assert cache_steps and all(isinstance(s, Alloc) for s in cache_steps)
    load_plan(layout).validate()


def test_the_cache_budget_still_bounds_an_offloading_layout():
    with pytest.raises(ValueError, match=r"dense weights 11000 B \+ expert cache 49000 B"):
        layout_for(None, make_sizes(), make_devices(1, BUDGET), 1, 1, kv_bytes=KV, cache_bytes=BUDGET - D)


def test_the_disk_tier_lists_no_expert_so_no_plan_moves_or_reads_one():
    sizes, devices = make_sizes(), make_devices(2, BUDGET)
    on_disk = layout_for(None, sizes, devices, 2, 2, kv_bytes=KV, cache_bytes=CACHE, host_experts=False)
    assert on_disk.offloads and not on_disk.host_experts
    assert all(key.kind != "expert" for key in on_disk.tensors(0)) and on_disk.host_bytes(0) == 0
    assert on_disk.total_bytes(0) == D + KV + CACHE  # what the device is charged does not change
    keys = {s.key.kind for s in load_plan(on_disk).steps if isinstance(s, DiskLoad | P2PCopy)}
    assert keys == {"dense"}
    down = plan(on_disk, scale_target(on_disk, 1, kv_bytes=KV))
    assert down.target.host_experts is False  # the tier carries through a scale
    assert all(s.key.kind != "expert" for s in down.steps if isinstance(s, DiskLoad | P2PCopy | Alloc | Free))
    with pytest.raises(ValueError, match="disk tier"):  # without a cache, the experts must be held somewhere
        layout_for(None, sizes, devices, 2, 2, kv_bytes=KV, host_experts=False)
