"""Planner tests on a synthetic model: D = 11000 B of dense tensors, X = 600 B per
expert (all layers), 32 experts, KV pool 40000 B per device, budget 100000 B."""

from __future__ import annotations

import dataclasses

import pytest
from hmm_factories import BUDGET, KV, D, X, make_devices, make_layout

from elasticmoe.parallel.expert_placement import ExpertPlacement
from hmm.expert_moves import max_overlap_placement, num_experts_kept
from hmm.layout import TensorKey
from hmm.planner import PlanError, load_plan, naive_full_copy_plan, plan, scale_target
from hmm.scale_plan import Alloc, DiskLoad, Free, InvalidPlan, P2PCopy, Remap, Reuse, ScalePlan

# (dp from, dp to, experts moved, bytes moved), by hand:
#   1->2: device 0 keeps 16 of 32; new device 1 gets D + 16 experts: 11000 + 16*600 = 20600
#   2->3: caps 11/11/10; devices 0, 1 keep 11 each, device 2 gets D + (5 + 5) experts: 11000 + 6000 = 17000
#   3->4: 11/11/10 -> 8 each; device 3 gets D + (3 + 3 + 2) experts: 11000 + 8*600 = 15800
#   4->2: 8 each -> 16 each; devices 0, 1 keep their 8 and get the 16 of devices 2, 3: 16*600 = 9600
#   3->1: device 0 keeps its 11 and gets 11 + 10 = 21 experts: 21*600 = 12600
CASES = [
    (1, 2, 16, D + 16 * X),
    (2, 3, 10, D + 10 * X),
    (3, 4, 8, D + 8 * X),
    (4, 2, 16, 16 * X),
    (3, 1, 21, 21 * X),
]


def scale(dp_from: int, dp_to: int, **kw) -> ScalePlan:
    current = make_layout(dp_from)
    return plan(current, scale_target(current, dp_to, make_devices(4)[dp_from:], kv_bytes=KV, **kw))


@pytest.mark.parametrize("dp_from,dp_to,experts_moved,bytes_moved", CASES)
def test_scaling_moves_the_hand_computed_minimum(dp_from, dp_to, experts_moved, bytes_moved):
    p = scale(dp_from, dp_to)
    p.validate()
    assert p.bytes_moved == p.bytes_p2p == bytes_moved and p.bytes_disk == 0
    assert p.num_experts_moved == experts_moved
    held = {d: p.current.local_experts(d) for d in p.current.device_ids}
    assert experts_moved == 32 - num_experts_kept(held, p.target.device_ids, 32)
    counts = [len(p.target.local_experts(d)) for d in p.target.device_ids]
    assert max(counts) - min(counts) <= 1 and sum(counts) == 32
    kept = set(p.current.device_ids) & set(p.target.device_ids)
    # Zero-copy on kept devices: all dense tensors, the KV pool and the experts that stay.
    stay = sum(len(set(p.current.local_experts(d)) & set(p.target.local_experts(d))) for d in kept)
    assert p.bytes_reused == len(kept) * (D + KV) + stay * X
    assert not any(isinstance(s, Remap) for s in p.steps)  # kept experts keep their slots


def test_dp2_to_dp3_plan_shape():
    p = scale(2, 3)
    assert p.target.local_experts(2) == (11, 12, 13, 14, 15, 27, 28, 29, 30, 31)
    assert p.target.local_experts(0) == tuple(range(11)) and p.target.local_experts(1) == tuple(range(16, 27))
    # Sources balanced: each old device sends 5 experts (3000) + half the dense bytes (5500).
    assert p.bytes_sent_by_device() == {0: 8500, 1: 8500}
    # Peak: old devices allocate nothing (16 experts until commit); device 2 ends at D + 10 X + KV.
    assert p.peak_bytes() == {0: D + 16 * X + KV, 1: D + 16 * X + KV, 2: D + 10 * X + KV}
    frees = [s for s in p.steps if isinstance(s, Free)]
    assert sum(s.nbytes for s in frees) == 10 * X and p.steps[-len(frees) :] == tuple(frees)
    # Naive second full copy: each old device also holds its new copy, 60600 + 57600 = 118200.
    naive = naive_full_copy_plan(p.current, scale_target(p.current, 3, make_devices(3)[2:], kv_bytes=KV))
    naive.validate(minimal=False)
    assert naive.peak_bytes()[0] == (D + 16 * X + KV) + (D + 11 * X + KV) == 118_200
    assert max(p.peak_bytes().values()) < max(naive.peak_bytes().values())
    with pytest.raises(InvalidPlan):
        naive.validate()  # second buffers of tensors the devices already hold


def test_scale_down_peak_is_the_final_size():
    p = scale(4, 2)
    # Device 0: 8 experts until commit plus 8 arriving = its final 16: D + 16 X + KV.
    assert p.peak_bytes()[0] == D + 16 * X + KV == p.target.total_bytes(0)
    assert {s.src_device for s in p.steps if isinstance(s, P2PCopy)} == {2, 3}
    assert sum(s.nbytes for s in p.steps if isinstance(s, Free) and s.device == 3) == D + 8 * X + KV


def test_ep_reshuffle_moves_and_remaps():
    current = make_layout(2)  # device 0: experts 0..15, device 1: 16..31
    # Swap experts 0 and 16 (same slot 0), and swap the slots of experts 1 and 2 on device 0.
    rank = [0] * 16 + [1] * 16
    rank[0], rank[16] = 1, 0
    slot = list(range(16)) * 2
    slot[1], slot[2] = 2, 1
    target = scale_target(current, 2, placement=ExpertPlacement(32, 2, tuple(rank), tuple(slot)))
    p = plan(current, target)
    assert p.num_experts_moved == 2 and p.bytes_moved == 2 * X  # 1200 B, no dense bytes
    remaps = [s for s in p.steps if isinstance(s, Remap)]
    assert len(remaps) == 2 * 4 and {(s.expert, s.from_slot, s.to_slot) for s in remaps} == {
        (1, 1, 2),
        (2, 2, 1),
    }
    assert sum(s.nbytes for s in remaps) == 2 * X and p.bytes_reused == 2 * (D + KV) + 30 * X


def test_plan_refuses_to_exceed_a_budget():
    current = make_layout(2, kv_bytes=None)  # KV pools fill each budget: no room for an arriving expert
    swap = tuple(1 if e == 0 else 0 if e == 16 else e // 16 for e in range(32))  # experts 0 <-> 16
    placement = ExpertPlacement(32, 2, swap, tuple(list(range(16)) * 2))
    with pytest.raises(PlanError, match="budget"):
        plan(current, scale_target(current, 2, placement=placement))


def test_dense_sources_prefer_the_same_node():
    current = make_layout(2, nodes=(0, 1, 0, 1))
    p = plan(current, scale_target(current, 4, make_devices(4, nodes=(0, 1, 0, 1))[2:], kv_bytes=KV))
    dense_src = {
        (s.dst_device, s.src_device) for s in p.steps if isinstance(s, P2PCopy) and s.key.kind == "dense"
    }
    assert dense_src == {(2, 0), (3, 1)}
    assert p.bytes_moved == 2 * D + 16 * X  # 32 experts, 8 per device: 4 + 4 leave each old device


def test_overlap_placement_gives_larger_capacity_to_fuller_devices():
    held = {0: (0,), 1: tuple(range(1, 13))}  # 13 experts, caps 7 and 6
    p = max_overlap_placement(held, (0, 1), 13)
    assert len(p.local_expert_ids(1)) == 7 and p.local_expert_ids(1)[:7] == tuple(range(1, 8))
    assert num_experts_kept(held, (0, 1), 13) == 1 + 7  # the other matching keeps 1 + 6


def test_load_plan_reads_each_tensor_once():
    target = make_layout(3)
    p = load_plan(target)
    assert p.bytes_disk == D + 32 * X  # each dense tensor and each expert once
    assert p.bytes_p2p == 2 * D  # the other two replicas of the dense tensors
    assert {s.device for s in p.steps if isinstance(s, DiskLoad) and s.key.kind == "dense"} == {0, 1, 2}


def _corrupt(p: ScalePlan, steps) -> ScalePlan:
    return dataclasses.replace(p, steps=tuple(steps))


def test_validate_catches_corrupted_plans():
    p = scale(4, 2)
    steps = list(p.steps)
    copy = next(i for i, s in enumerate(steps) if isinstance(s, P2PCopy))
    src = steps[copy]
    free = next(
        i
        for i, s in enumerate(steps)
        if isinstance(s, Free) and (s.device, s.key) == (src.src_device, src.key)
    )
    read_after_free = steps[:copy] + [steps[free]] + steps[copy:free] + steps[free + 1 :]
    with pytest.raises(InvalidPlan, match="freed by an earlier step"):
        _corrupt(p, read_after_free).validate()
    missing = steps[: copy - 1] + steps[copy + 1 :]  # drop one expert's Alloc + P2PCopy
    with pytest.raises(InvalidPlan, match="not on device"):
        _corrupt(p, missing).validate()
    kept_key = TensorKey.dense("embed")
    with pytest.raises(InvalidPlan, match="frees target tensor"):
        _corrupt(p, steps + [Free(0, kept_key, 4000)]).validate()
    with pytest.raises(InvalidPlan, match="disk-loads"):
        _corrupt(
            p, steps[:copy] + [DiskLoad(src.dst_device, src.key, src.nbytes)] + steps[copy + 1 :]
        ).validate()
    moved_slot = TensorKey.expert_row("layers.0.moe.w13", 0, 0)  # slot 0 -> 1 under _swapped_slots
    with pytest.raises(InvalidPlan, match="cannot"):
        _corrupt(scale(2, 2, placement=_swapped_slots()), [Reuse(0, moved_slot, 200)]).validate()
    with pytest.raises(InvalidPlan, match="second buffer"):
        _corrupt(p, [Alloc(0, kept_key, 4000)] + steps).validate()


def _swapped_slots() -> ExpertPlacement:
    slot = list(range(16)) * 2
    slot[0], slot[1] = 1, 0
    return ExpertPlacement(32, 2, tuple([0] * 16 + [1] * 16), tuple(slot))


def test_budget_accounting_of_new_devices_defaults_to_budget_minus_weights():
    current = make_layout(2)
    p = plan(current, scale_target(current, 3, make_devices(3)[2:]))
    assert p.target.kv_bytes == (KV, KV, BUDGET - D - 10 * X)
    assert p.over_budget() == {}


# ---- devices leaving (a drained node) and lost (a dead node) ---------------------------------


def test_a_leaving_device_is_replaced_by_a_new_one_at_the_same_dp():
    current = make_layout(2, nodes=(0, 1))
    devices = make_devices(3, nodes=(0, 1, 2))
    target = scale_target(current, 2, devices[2:], kv_bytes=KV, leaving={1})
    assert [d.device_id for d in target.devices] == [0, 2]
    p = plan(current, target)
    p.validate()
    # Device 2 gets the dense tensors and device 1's 16 experts, all by p2p (device 1 still serves).
    assert p.bytes_p2p == D + 16 * X and p.bytes_disk == 0
    assert {s.src_device for s in p.steps if isinstance(s, P2PCopy) and s.key.kind == "expert"} == {1}
    assert sum(s.nbytes for s in p.steps if isinstance(s, Free) and s.device == 1) == D + KV + 16 * X


def test_leaving_devices_shrink_dp_when_no_device_is_free():
    current = make_layout(3)
    target = scale_target(current, 2, (), kv_bytes=KV, leaving={0})
    assert [d.device_id for d in target.devices] == [1, 2]
    with pytest.raises(ValueError, match="needs 1 new devices"):
        scale_target(current, 3, (), kv_bytes=KV, leaving={0})


def test_a_lost_device_is_never_a_source_nor_freed():
    current = make_layout(3, nodes=(0, 1, 1))
    survivors = make_devices(4, nodes=(0, 1, 1, 2))
    # Devices 1 and 2 (node 1) died; device 3 (node 2) joined: dp 3 -> 2 on devices 0 and 3.
    target = scale_target(current, 2, survivors[3:], kv_bytes=KV, leaving={1, 2})
    p = plan(current, target, lost={1, 2})
    p.validate()
    assert p.device_ids() == (0, 3) and p.lost == {1, 2}
    sources = {s.src_device for s in p.steps if isinstance(s, P2PCopy)}
    assert sources == {0}  # dense tensors from the surviving replica
    lost_experts = set(current.local_experts(1)) | set(current.local_experts(2))
    from_disk = {s.key.expert_id for s in p.steps if isinstance(s, DiskLoad)}
    assert from_disk == lost_experts  # only the dead devices held them: read from disk, once each
    assert not any(isinstance(s, Free) and s.device in (1, 2) for s in p.steps)
    assert set(p.peak_bytes()) == {0, 3}
    assert sum(len(p.target.local_experts(d)) for d in p.target.device_ids) == 32


def test_a_lost_device_cannot_be_in_the_target():
    current = make_layout(2)
    with pytest.raises(PlanError, match="lost"):
        plan(current, scale_target(current, 1, kv_bytes=KV), lost={0})
    with pytest.raises(ValueError, match="lost devices"):
        ScalePlan(current, current, (), lost=frozenset({0}))


def test_every_device_lost_reloads_everything_from_disk():
    current = make_layout(1, nodes=(0,))
    fresh = make_devices(2, nodes=(0, 1))[1:]
    p = plan(current, scale_target(current, 1, fresh, kv_bytes=KV, leaving={0}), lost={0})
    p.validate()
    assert p.bytes_p2p == 0 and p.bytes_disk == D + 32 * X and p.device_ids() == (1,)
