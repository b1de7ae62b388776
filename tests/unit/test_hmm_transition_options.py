"""Planner under `TransitionOptions` (the paper's baselines and ablations), on the
synthetic model of `hmm_factories`: D = 11000 B dense, X = 600 B per expert, 32
experts, KV pool 40000 B; budgets doubled so second copies fit.

Hand-computed layouts (balanced placements, kept experts keep their slots):
- DP2 -> DP3: devices 0 / 1 hold 16 experts, keep 11, lose 5 each; new device 2
  gets D + 10 experts. Both kept devices' expert lists change.
- DP3 -> DP2: devices 0 / 1 hold 11, keep them and receive 5 each of device 2's 10.
"""

from __future__ import annotations

from collections import Counter

import pytest
from hmm_factories import KV, D, X, make_devices, make_layout

from elasticmoe.parallel.expert_placement import ExpertPlacement
from hmm.layout import DeviceSpec, TensorKey
from hmm.planner import PlanError, TargetConfig, naive_full_copy_plan, plan, scale_target
from hmm.scale_plan import (
    Alloc,
    DiskLoad,
    Free,
    InvalidPlan,
    LocalCopy,
    P2PCopy,
    Remap,
    Reuse,
    ScalePlan,
)
from hmm.transition_options import TransitionOptions

BIG = 200_000  # budget per device: room for a second full copy (2 x 60600)
FULL = D + 16 * X + KV  # a device with 16 experts: 60600

DEFAULT = TransitionOptions()
NO_REMAP = TransitionOptions(paged_remap=False)
NO_REMAP_P2P = TransitionOptions(paged_remap=False, p2p=False)
NOTHING = TransitionOptions(zero_copy=False, paged_remap=False, p2p=False)
NO_ZERO_COPY = TransitionOptions(zero_copy=False)  # p2p on: kept tensors copied locally


def scale(dp_from: int, dp_to: int, options: TransitionOptions, **kw) -> ScalePlan:
    current = make_layout(dp_from, budget=BIG)
    target = scale_target(current, dp_to, make_devices(4, BIG)[dp_from:], kv_bytes=KV, **kw)
    p = plan(current, target, options)
    p.validate(minimal=False)
    assert p.options == options
    return p


def steps_of(p: ScalePlan, kind: type) -> list:
    return [s for s in p.steps if isinstance(s, kind)]


def freed(p: ScalePlan, device: int) -> int:
    return sum(s.nbytes for s in steps_of(p, Free) if s.device == device)


# options, bytes p2p, bytes disk, bytes local copy, bytes allocated, peak of device 0, peak of device 2
UP = [
    (DEFAULT, D + 10 * X, 0, 0, D + 10 * X + KV, FULL, D + 10 * X + KV),
    # kept experts of devices 0, 1 (11 each) get new stacks: +11 X peak on each
    (NO_REMAP, D + 10 * X, 0, 22 * X, D + 32 * X + KV, FULL + 11 * X, D + 10 * X + KV),
    (NO_REMAP_P2P, 0, D + 10 * X, 22 * X, D + 32 * X + KV, FULL + 11 * X, D + 10 * X + KV),
    # every target tensor new and from disk; device 0 holds its old and its new copy (D + 11 X + KV)
    (NOTHING, 0, 3 * D + 32 * X, 0, 3 * (D + KV) + 32 * X, FULL + D + 11 * X + KV, D + 10 * X + KV),
    # device 2 by p2p; kept devices copy their own dense tensors and 11 experts
    (
        NO_ZERO_COPY,
        D + 10 * X,
        0,
        2 * (D + 11 * X),
        3 * (D + KV) + 32 * X,
        FULL + D + 11 * X + KV,
        D + 10 * X + KV,
    ),
]


@pytest.mark.parametrize("options,p2p,disk,local,alloc,peak0,peak2", UP)
def test_dp2_to_dp3_under_options(options, p2p, disk, local, alloc, peak0, peak2):
    p = scale(2, 3, options)
    assert (p.bytes_p2p, p.bytes_disk, p.bytes_local_copy, p.bytes_allocated) == (p2p, disk, local, alloc)
    assert p.peak_bytes() == {0: peak0, 1: peak0, 2: peak2}
    assert bool(steps_of(p, LocalCopy)) == (local > 0)
    assert all(s.device in (0, 1) for s in steps_of(p, LocalCopy))  # only kept devices copy locally
    # Commit frees the lost experts and every renewed buffer: each kept device ends at D + 11 X + KV.
    assert freed(p, 0) == peak0 - (D + 11 * X + KV)
    assert p.bytes_reused == (
        2 * (D + KV + 11 * X) if options == DEFAULT else 2 * (D + KV) if options.zero_copy else 0
    )


# options, bytes p2p, bytes disk, bytes local copy, bytes allocated, peak of device 0
DOWN = [
    (DEFAULT, 10 * X, 0, 0, 10 * X, FULL),
    (NO_REMAP, 10 * X, 0, 22 * X, 32 * X, FULL + 11 * X),
    (NO_REMAP_P2P, 0, 10 * X, 22 * X, 32 * X, FULL + 11 * X),
    (NOTHING, 0, 2 * (D + 16 * X), 0, 2 * FULL, D + 11 * X + KV + FULL),
]


@pytest.mark.parametrize("options,p2p,disk,local,alloc,peak0", DOWN)
def test_dp3_to_dp2_under_options(options, p2p, disk, local, alloc, peak0):
    p = scale(3, 2, options)
    assert (p.bytes_p2p, p.bytes_disk, p.bytes_local_copy, p.bytes_allocated) == (p2p, disk, local, alloc)
    # Device 2 leaves: it allocates nothing and frees everything at commit.
    assert p.peak_bytes() == {0: peak0, 1: peak0, 2: D + 10 * X + KV}
    assert freed(p, 2) == D + 10 * X + KV
    assert freed(p, 0) == peak0 - FULL
    assert bool(steps_of(p, LocalCopy)) == (local > 0)


def test_default_options_give_todays_minimal_plan():
    current = make_layout(2, budget=BIG)
    target = scale_target(current, 3, make_devices(3, BIG)[2:], kv_bytes=KV)
    assert plan(current, target) == plan(current, target, TransitionOptions())
    plan(current, target).validate(minimal=True)
    with pytest.raises(InvalidPlan):
        scale(2, 3, NO_REMAP).validate(minimal=True)  # second buffers are not minimal


def test_no_zero_copy_no_p2p_is_the_naive_full_copy():
    current = make_layout(2, budget=BIG)
    target = scale_target(current, 3, make_devices(3, BIG)[2:], kv_bytes=KV)
    p = plan(current, target, NOTHING)
    assert Counter(p.steps) == Counter(naive_full_copy_plan(current, target).steps)
    assert not steps_of(p, Reuse) and not steps_of(p, P2PCopy)
    # New KV pools on every target device, never filled; the old pools are freed at commit.
    kv = TensorKey.kv()
    assert {s.device for s in steps_of(p, Alloc) if s.key == kv} == {0, 1, 2}
    assert {s.device for s in steps_of(p, Free) if s.key == kv} == {0, 1}


def _placement(local: list[list[int]]) -> ExpertPlacement:
    rank, slot = [0] * 32, [0] * 32
    for r, experts in enumerate(local):
        for s, e in enumerate(experts):
            rank[e], slot[e] = r, s
    return ExpertPlacement(32, len(local), tuple(rank), tuple(slot))


def test_no_paged_remap_reuses_unchanged_stacks_and_copies_remapped_ones():
    # Device 0 keeps its 16 experts as they are; device 1 keeps 6 in reversed slots; device 2 gets 10.
    placement = _placement([list(range(16)), list(range(21, 15, -1)), list(range(22, 32))])
    p = scale(2, 3, DEFAULT, placement=placement)
    assert {s.key.expert for s in steps_of(p, Remap)} == set(range(16, 22))
    assert p.peak_bytes()[0] == p.peak_bytes()[1] == FULL
    q = scale(2, 3, NO_REMAP, placement=placement)
    assert not steps_of(q, Remap)
    assert {s.key.expert for s in steps_of(q, Reuse) if s.key.kind == "expert"} == set(range(16))
    assert {(s.device, s.key.expert) for s in steps_of(q, LocalCopy)} == {(1, e) for e in range(16, 22)}
    assert q.peak_bytes() == {0: FULL, 1: FULL + 6 * X, 2: D + 10 * X + KV}
    assert q.bytes_p2p == p.bytes_p2p == D + 10 * X


def test_disjoint_target_without_p2p_loads_everything_from_disk():
    current = make_layout(2, budget=BIG)
    fresh = (DeviceSpec(2, 0, BIG), DeviceSpec(3, 0, BIG))
    p = plan(current, TargetConfig(fresh, 2, 2, kv_bytes=KV), TransitionOptions(p2p=False))
    p.validate(minimal=False)
    assert p.bytes_disk == 2 * (D + 16 * X) and p.bytes_p2p == p.bytes_reused == p.bytes_local_copy == 0
    assert {type(s) for s in p.steps} == {Alloc, DiskLoad, Free}
    assert all(s.device in (2, 3) for s in p.steps if not isinstance(s, Free))
    # Every old tensor is freed at commit, nothing else.
    assert Counter(steps_of(p, Free)) == Counter(
        Free(d, k, n) for d in (0, 1) for k, n in current.tensors(d).items()
    )
    assert p.peak_bytes() == {0: FULL, 1: FULL, 2: FULL, 3: FULL}
    # With p2p the same target is filled from the old devices and the plan is minimal.
    q = plan(current, TargetConfig(fresh, 2, 2, kv_bytes=KV))
    q.validate(minimal=True)
    assert q.bytes_p2p == 2 * (D + 16 * X) and q.bytes_disk == 0


def test_second_copies_are_checked_against_the_budget():
    current = make_layout(2)  # budget 100000: one copy (60600) fits, two (118200) do not
    target = scale_target(current, 3, make_devices(3)[2:], kv_bytes=KV)
    plan(current, target, NO_REMAP)  # + 11 X fits
    with pytest.raises(PlanError, match="budget"):
        plan(current, target, NOTHING)


def test_validate_checks_local_copies():
    p = scale(2, 3, NO_REMAP)
    i = next(i for i, s in enumerate(p.steps) if isinstance(s, LocalCopy))
    copy = p.steps[i]
    assert p.steps[i - 1] == Alloc(copy.device, copy.key, copy.nbytes)

    def corrupt(steps) -> ScalePlan:
        return ScalePlan(p.current, p.target, tuple(steps), p.options)

    with pytest.raises(InvalidPlan, match="without an empty buffer"):  # no new buffer to fill
        corrupt(p.steps[: i - 1] + p.steps[i:]).validate(minimal=False)
    with pytest.raises(InvalidPlan, match="without an empty buffer"):  # copied twice
        corrupt(p.steps[: i + 1] + (copy,) + p.steps[i + 1 :]).validate(minimal=False)
    with pytest.raises(InvalidPlan, match="not filled|exactly once"):  # never filled
        corrupt(p.steps[:i] + p.steps[i + 1 :]).validate(minimal=False)
    # A device that never held the key has no older buffer to copy from.
    arrival = next(s for s in p.steps if isinstance(s, P2PCopy) and s.dst_device == 2)
    j = p.steps.index(arrival)
    local = LocalCopy(2, arrival.key, arrival.nbytes)
    with pytest.raises(InvalidPlan, match="without an older filled buffer"):
        corrupt(p.steps[:j] + (local,) + p.steps[j + 1 :]).validate(minimal=False)
    with pytest.raises(ValueError):
        LocalCopy(0, TensorKey.kv(), KV)
