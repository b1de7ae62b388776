"""ESFT expert map Π and batched rerouting (ExpertWeave §4.3) against a per-token reference."""

from __future__ import annotations

import pytest
import torch

from elasticmoe.adapters.expert_map import ExpertMap, reroute_naive
from elasticmoe.parallel.expert_placement import ExpertPlacement


def test_reroute_matches_the_per_token_reference_for_a_mixed_batch():
    m = ExpertMap(ExpertPlacement.balanced(64, 1), max_adapters=2, max_experts=8)
    m.set_adapter(0, (3, 26, 47))  # the paper's Fig. 4 shape: M=64, N=2, E_max=8
    m.set_adapter(1, (0, 31, 58, 60, 5, 9, 11))
    gen = torch.Generator().manual_seed(0)
    topk = torch.stack([torch.randperm(64, generator=gen)[:6] for _ in range(40)])
    aids = torch.randint(-1, 2, (40,), generator=gen)
    want = reroute_naive(topk, aids, {0: {3: 64, 26: 65, 47: 66},
                                      1: {e: 72 + i for i, e in enumerate((0, 31, 58, 60, 5, 9, 11))}})
    assert torch.equal(m.reroute(topk, aids), want)
    assert torch.equal(m.reroute(topk, torch.full((40,), -1)), topk)  # base tokens are untouched


def test_tables_place_adapter_experts_beside_their_base_expert_under_ep():
    placement = ExpertPlacement.balanced(8, 2)  # rank 0: experts 0-3, rank 1: 4-7
    m = ExpertMap(placement, max_adapters=3, max_experts=2)
    m.set_adapter(2, (6, 1))
    v6, v1 = m.virtual_id(2, 0), m.virtual_id(2, 1)
    assert (v6, v1) == (8 + 2 * 2, 8 + 2 * 2 + 1)
    assert (m.rank_of[v6].item(), m.slot_of[v6].item()) == (1, 4 + 2 * 2 + 0)  # rank 1 holds 4 base experts
    assert (m.rank_of[v1].item(), m.slot_of[v1].item()) == (0, 4 + 2 * 2 + 1)
    assert torch.equal(m.rank_of[:8], torch.tensor(placement.expert_to_rank))
    m.clear_adapter(2)
    ids = torch.tensor([[6, 1]])
    assert torch.equal(m.reroute(ids, torch.tensor([2])), ids)


def test_limits():
    m = ExpertMap(ExpertPlacement.balanced(8, 1), max_adapters=1, max_experts=2)
    with pytest.raises(ValueError, match="max_experts=2"):
        m.set_adapter(0, (1, 2, 3))
    with pytest.raises(ValueError, match="adapter slot 1"):
        m.set_adapter(1, (1,))
    with pytest.raises(ValueError):
        ExpertMap(ExpertPlacement.balanced(8, 1), max_adapters=0, max_experts=1)
