"""FineMoE's per-expert decisions on hand-made numbers: the similarity-aware threshold, the
minimum expert set (eqs. 6-8), the prefetch priority and the eviction priority (§4.3, §4.5)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from elasticmoe.offload.selection import (
    PROB_FLOOR,
    eviction_priority,
    minimum_expert_set,
    minimum_expert_sets,
    prefetch_priority,
    selection_threshold,
)


def test_threshold_is_one_minus_score_clipped_to_unit_interval():
    assert selection_threshold(1.0) == 0.0
    assert selection_threshold(0.3) == pytest.approx(0.7)
    assert selection_threshold(-0.5) == 1.0
    assert selection_threshold(1.2) == 0.0


def test_minimum_expert_set_covers_the_threshold_with_at_least_k_experts():
    probs = torch.tensor([0.1, 0.5, 0.2, 0.2])
    assert minimum_expert_set(probs, 0.6, top_k=1) == [1, 2]  # 0.5 + 0.2 >= 0.6 (eq. 7)
    assert minimum_expert_set(probs, 0.6, top_k=3) == [1, 2, 3]  # eq. 8: never fewer than K
    assert minimum_expert_set(probs, 0.0, top_k=2) == [1, 2]  # a perfect match: just K
    assert minimum_expert_set(probs, 0.5, top_k=1) == [1]  # reaching the threshold exactly is enough
    assert minimum_expert_set(probs, 1.0, top_k=1) == [1, 2, 3, 0]  # no confidence: everything
    # a total a rounding hair under 1 still yields every expert, not an error
    assert minimum_expert_set(torch.tensor([0.3333333, 0.3333333, 0.3333333]), 1.0, top_k=1) == [0, 1, 2]
    with pytest.raises(ValueError):
        minimum_expert_set(probs, 0.5, top_k=5)


def test_the_batched_minimum_expert_sets_equal_one_set_per_row():
    gen = np.random.default_rng(0)
    probs = gen.dirichlet(np.full(8, 0.3), size=16)
    probs[3] = [0.25, 0.25, 0.25, 0.25, 0, 0, 0, 0]  # ties go to the lower id
    thresholds = gen.uniform(0, 1, size=16)
    thresholds[:2] = (0.0, 1.0)
    order, counts = minimum_expert_sets(probs, thresholds, top_k=2)
    for row, threshold, ids, count in zip(probs, thresholds, order, counts, strict=True):
        assert ids[:count].tolist() == minimum_expert_set(row, threshold, top_k=2)


def test_thresholds_and_priorities_work_elementwise_on_arrays():
    assert selection_threshold(np.array([1.0, 0.3, -0.5])).tolist() == pytest.approx([0.0, 0.7, 1.0])
    assert prefetch_priority(np.array([0.6, 0.6]), np.array([3, 2]), 1).tolist() == pytest.approx([0.3, 0.6])
    with pytest.raises(ValueError):
        prefetch_priority(np.array([0.6, 0.6]), np.array([3, 1]), 1)


def test_prefetch_priority_favours_likely_and_near_experts():
    assert prefetch_priority(0.6, layer=3, current_layer=1) == pytest.approx(0.3)
    assert prefetch_priority(0.6, layer=0, current_layer=-1) == pytest.approx(0.6)  # before layer 0
    near, far = prefetch_priority(0.4, 2, 1), prefetch_priority(0.4, 4, 1)
    assert near > far
    with pytest.raises(ValueError):
        prefetch_priority(0.5, layer=1, current_layer=1)


def test_eviction_priority_is_one_over_p_times_freq():
    probs = np.array([[0.5, 0.5, 0.1, 0.0]])
    visits = np.array([[3, 0, 3, 3]])
    got = eviction_priority(probs, visits)
    # freq = visits + 1: a load is the first visit
    assert got[0].tolist() == pytest.approx([1 / (0.5 * 4), 1 / (0.5 * 1), 1 / (0.1 * 4), 1 / (PROB_FLOOR * 4)])
    assert got.argmax() == 3  # what the searched map gives no chance goes first
    assert eviction_priority(0.25, 1) == pytest.approx(2.0)
