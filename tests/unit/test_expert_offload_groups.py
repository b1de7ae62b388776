"""`expert_offload._groups`: rows sorted by slot -> group bounds and each group's slot, the same
from the Python loop (a decode step's few rows) and from NumPy (a prefill's many)."""

from __future__ import annotations

import pytest
import torch

from elasticmoe.engine import expert_offload
from elasticmoe.engine.expert_offload import _groups


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
