"""`expert_offload`'s per-step helpers: `_groups` (rows sorted by slot -> group bounds and each
group's slot, the same from the Python loop of a decode step's few rows and from NumPy for a
prefill's many) and `_mean_embedding` (a request's semantic embedding, one token's by its row)."""

from __future__ import annotations

import pytest
import torch

from elasticmoe.engine import expert_offload
from elasticmoe.engine.expert_offload import _groups, _mean_embedding


def reference(slots: list[int]) -> tuple[list[int], list[int]]:
    bounds, ids = [], []
    for i, slot in enumerate(slots):
        if i == 0 or slot != slots[i - 1]:
            bounds.append(i)
            ids.append(slot)
    return bounds + [len(slots)], ids


@pytest.mark.parametrize("num_rows", [1, 4, expert_offload._GROUP_IN_PYTHON, expert_offload._GROUP_IN_PYTHON + 1, 700])
def test_groups_equal_the_rows_runs_on_either_path(num_rows):
    gen = torch.Generator().manual_seed(num_rows)
    slots = torch.randint(0, 32, (num_rows,), generator=gen).sort().values
    assert _groups(slots) == reference(slots.tolist())


def test_one_slot_and_all_distinct_slots():
    assert _groups(torch.tensor([5, 5, 5])) == ([0, 3], [5])
    assert _groups(torch.arange(100)) == (list(range(101)), list(range(100)))
    assert _groups(torch.full((100,), 7)) == ([0, 100], [7])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_mean_embedding_of_one_token_is_its_row_and_of_several_their_mean(dtype):
    embed = torch.randn(50, 16).to(dtype)
    one = _mean_embedding(embed, [7])
    assert one.dtype == torch.float32 and torch.equal(one, embed[7:8].float().mean(dim=0))
    several = _mean_embedding(embed, [7, 3, 7])
    assert several.dtype == torch.float32 and torch.equal(several, embed[[7, 3, 7]].float().mean(dim=0))
