"""FineMoE's per-expert decisions on hand-made numbers: the similarity-aware threshold, the
minimum expert set (eqs. 6-8) and its floor for iterations of several tokens, the prefetch
priority and the eviction priority (§4.3, §4.5)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from elasticmoe.offload.selection import (
    PROB_FLOOR,
    eviction_priority,
    iteration_floor,
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


def test_the_floor_of_an_iteration_of_several_tokens_is_the_expected_union_of_their_top_k():
    # K = 2: each token picks expert j with q_j = min(1, 2 p_j) = [1, 0.6, 0.4, 0]
    probs = np.array([[0.5, 0.3, 0.2, 0.0]] * 3)
    # T = 1: K, as eq. 8; T = 2: 1 + (1 - 0.4^2) + (1 - 0.6^2) = 2.48 -> 3; T = 10: 2.9938 -> 3
    assert iteration_floor(probs, [1, 2, 10], top_k=2).tolist() == [2, 3, 3]
    # uniform over 8, K = 2 (q = 0.25): T = 4 gives 8 (1 - 0.75^4) = 5.47 -> 6; T = 64 all 8
    uniform = np.full((3, 8), 0.125)
    assert iteration_floor(uniform, [1, 4, 64], top_k=2).tolist() == [2, 6, 8]
    # a row summing a hair over 1 (float32 maps do) expects 2 + 1e-6 at T = 2: still 2, not 3
    assert iteration_floor(np.array([[0.5, 0.5, 2.5e-7, 0.0]]), [2], top_k=2).tolist() == [2]
    with pytest.raises(ValueError, match="num_tokens"):
        iteration_floor(probs, [1, 0, 2], top_k=2)
    with pytest.raises(ValueError, match="num_tokens"):
        iteration_floor(probs, [1, 2], top_k=2)


def test_a_minimum_expert_set_for_several_tokens_covers_the_threshold_and_the_floor():
    probs = torch.tensor([0.1, 0.5, 0.2, 0.2])
    assert minimum_expert_set(probs, 0.0, top_k=1, num_tokens=1) == [1]
    # K = 1, T = 3: 3 tokens each picking with q = p: 0.271 + 0.875 + 0.488 + 0.488 = 2.12 -> 3
    assert minimum_expert_set(probs, 0.0, top_k=1, num_tokens=3) == [1, 2, 3]
    assert minimum_expert_set(probs, 1.0, top_k=1, num_tokens=3) == [1, 2, 3, 0]  # the threshold wins
    order, counts = minimum_expert_sets(probs[None].numpy().repeat(2, 0), np.zeros(2), 1, np.array([1, 3]))
    assert counts.tolist() == [1, 3]


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
