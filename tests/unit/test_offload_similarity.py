"""FineMoE's scores on hand-made vectors: semantic (eq. 4), trajectory (eq. 5), redundancy (§4.4)."""

from __future__ import annotations

import math

import pytest
import torch

from elasticmoe.offload.similarity import (
    best_matches,
    cosine_scores,
    redundancy_scores,
    semantic_scores,
    trajectory_scores,
)


def test_semantic_score_is_the_cosine_of_embeddings():
    new = torch.tensor([[1.0, 0.0], [1.0, 1.0]])
    old = torch.tensor([[2.0, 0.0], [0.0, 3.0], [-1.0, 0.0]])
    scores = semantic_scores(new, old)  # [B=2, C=3]
    want = torch.tensor([[1.0, 0.0, -1.0], [1 / math.sqrt(2), 1 / math.sqrt(2), -1 / math.sqrt(2)]])
    assert torch.allclose(scores, want, atol=1e-6)


def test_trajectory_score_flattens_the_layers_it_compares():
    # two layers of two experts: the new iteration routes like stored map 1 in both layers
    new = torch.tensor([[[0.9, 0.1], [0.2, 0.8]]])  # [B=1, n=2, E=2]
    old = torch.tensor([[[0.1, 0.9], [0.8, 0.2]],
                        [[0.9, 0.1], [0.2, 0.8]]])  # [C=2, 2, 2]
    scores = trajectory_scores(new, old)
    assert scores.shape == (1, 2)
    assert scores[0, 1] == pytest.approx(1.0)
    flat_cos = (0.9 * 0.1 + 0.1 * 0.9 + 0.2 * 0.8 + 0.8 * 0.2) / (0.9**2 + 0.1**2 + 0.2**2 + 0.8**2)
    assert scores[0, 0] == pytest.approx(flat_cos)
    with pytest.raises(ValueError):
        trajectory_scores(new, old[:, :1])  # different numbers of layers


def test_redundancy_weights_semantic_by_d_over_l():
    sem_new, sem_old = torch.tensor([[1.0, 0.0]]), torch.tensor([[0.0, 1.0]])  # score^sem = 0
    map_new = torch.tensor([[[1.0, 0.0]] * 4])  # [1, L=4, E=2]
    map_old = torch.tensor([[[1.0, 0.0]] * 4])  # score^traj = 1
    for d, want in ((0, 1.0), (1, 0.75), (3, 0.25), (4, 0.0)):
        assert redundancy_scores(sem_new, sem_old, map_new, map_old, d).item() == pytest.approx(want)
    with pytest.raises(ValueError):
        redundancy_scores(sem_new, sem_old, map_new, map_old, 5)


def test_best_match_per_row_and_zero_vectors():
    index, score = best_matches(torch.tensor([[0.1, 0.7, 0.7], [0.9, 0.2, -1.0]]))
    assert index.tolist() == [1, 0]  # a tie goes to the lower index
    assert score.tolist() == pytest.approx([0.7, 0.9])
    assert cosine_scores(torch.zeros(1, 3), torch.ones(2, 3)).tolist() == [[0.0, 0.0]]
    with pytest.raises(ValueError):
        best_matches(torch.zeros(1, 0))
