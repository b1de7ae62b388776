"""Load-balanced expert placement (`hmm.expert_moves.balance_expert_load`): hand-computed swaps on
small cases, and the planner using it when a scale knows the experts' expected load."""

from __future__ import annotations

import pytest
from hmm_factories import make_devices, make_layout

from elasticmoe.parallel.expert_placement import ExpertPlacement
from hmm.expert_moves import balance_expert_load, load_imbalance, rank_loads
from hmm.planner import plan, scale_target


def test_the_best_swap_is_taken_and_the_search_stops_when_none_helps():
    # Rank 0 holds experts 0, 1, 2 (load 10 + 4 + 2), rank 1 holds 3, 4, 5 (1 + 1 + 0): 16 vs 2, mean 9.
    before = ExpertPlacement.balanced(6, 2)
    load = [10, 4, 2, 1, 1, 0]
    assert rank_loads(before, load) == [16, 2] and load_imbalance(before, load) == pytest.approx(16 / 9)
    after = balance_expert_load(before, load)
    # A swap moving d from rank 0 to rank 1 leaves max(16 - d, 2 + d): d = 10 - 1 = 9 gives 11, the
    # best (expert 0 for expert 3, the first of the two with load 1). Then no swap of the busier rank
    # 1 (10, 1, 0) with rank 0 (1, 4, 2) brings it below 11: the search stops at 7 vs 11.
    assert rank_loads(after, load) == [7, 11]
    assert [len(after.local_expert_ids(r)) for r in range(2)] == [3, 3]
    assert (after.expert_to_rank[0], after.expert_to_slot[0]) == (1, before.expert_to_slot[3])
    assert (after.expert_to_rank[3], after.expert_to_slot[3]) == (0, before.expert_to_slot[0])


def test_a_balanced_or_idle_placement_is_left_as_it_is():
    placement = ExpertPlacement.balanced(6, 3)
    assert balance_expert_load(placement, [1, 2, 2, 1, 1, 2]) == placement  # 3, 3, 3
    assert balance_expert_load(placement, [0] * 6) == placement
    assert load_imbalance(placement, [0] * 6) == 1.0


def test_it_stops_within_the_tolerance_and_never_makes_the_busiest_rank_busier():
    placement = ExpertPlacement.balanced(8, 2)
    load = [8, 7, 6, 5, 1, 1, 1, 1]  # 26 vs 4
    after = balance_expert_load(placement, load, tolerance=0.0)
    assert max(rank_loads(after, load)) == 15  # 30 in all: 15 / 15 is reachable by two swaps
    one_swap = balance_expert_load(placement, load, tolerance=0.5)  # 26 -> 19 is within 1.5 x 15
    moved = sum(a != b for a, b in zip(one_swap.expert_to_rank, placement.expert_to_rank, strict=True))
    assert max(rank_loads(one_swap, load)) < 26 and moved == 2


def test_wrong_loads_are_refused():
    placement = ExpertPlacement.balanced(4, 2)
    with pytest.raises(ValueError, match="one value per expert"):
        balance_expert_load(placement, [1, 2, 3])
    with pytest.raises(ValueError, match=">= 0"):
        balance_expert_load(placement, [1, -2, 3, 4])


def test_a_scale_with_known_load_spreads_the_hot_experts():
    current = make_layout(1)  # 32 experts on device 0
    load = [100.0] * 8 + [1.0] * 24  # experts 0-7 are hot
    counted = plan(current, scale_target(current, 2, make_devices(2)[1:])).target
    balanced = plan(current, scale_target(current, 2, make_devices(2)[1:], expert_load=load)).target
    assert load_imbalance(counted.placement, load) > 1.5  # count-balanced: all hot experts stay on rank 0
    assert load_imbalance(balanced.placement, load) <= 1.05
    assert [len(balanced.local_experts(d)) for d in (0, 1)] == [16, 16]  # same memory per device
