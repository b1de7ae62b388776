"""Batched LoRA for a mixed batch (S-LoRA/Punica style, MoLoRA §5): one computation per site.

Every LoRA site (a linear layer some adapter may target) keeps its adapters' factors in
fixed slots: `A [K, r_max, in]`, `B [K, out, r_max]` (the scaling folded into B; ranks
below r_max zero-padded). Each row of the batch carries a key (its adapter's slot, or
for expert sites slot * E + expert; -1: no adapter). `LoraGroups` groups the rows by key
once per forward; `delta` then runs two batched GEMMs over the groups
(`[G, C, in] x [G, in, r] -> [G, C, r] x [G, r, out]`, C = the largest group), whatever
mix of adapters the batch holds: no per-adapter pass, no per-token loop.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class LoraGroups:
    """Rows of a batch grouped by LoRA key (see the module docstring)."""

    num_rows: int
    rows: torch.Tensor  # [R] rows that have a key, grouped by key
    keys: torch.Tensor  # [G] the distinct keys, ascending
    pad_index: torch.Tensor  # [R] where each row sits in the padded [G * C] buffer
    capacity: int  # C

    @classmethod
    def build(cls, keys: torch.Tensor) -> LoraGroups | None:
        """Groups of `keys` [N] (-1: no adapter); None if no row has one."""
        rows = torch.nonzero(keys >= 0).flatten()
        if rows.numel() == 0:
            return None
        row_keys = keys.index_select(0, rows)
        order = torch.argsort(row_keys, stable=True)
        rows, row_keys = rows.index_select(0, order), row_keys.index_select(0, order)
        used, counts = torch.unique_consecutive(row_keys, return_counts=True)
        capacity = int(counts.max())
        starts = torch.cumsum(counts, 0) - counts
        group = torch.repeat_interleave(torch.arange(used.numel()), counts)
        rank_in_group = torch.arange(rows.numel()) - starts.index_select(0, group)
        return cls(keys.numel(), rows, used, group * capacity + rank_in_group, capacity)

    def delta(self, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        """x [N, in], a [K, r, in], b [K, out, r] -> the rows' LoRA outputs [N, out] (0 without a key)."""
        num_groups, width = self.keys.numel(), x.shape[1]
        padded = x.new_zeros((num_groups * self.capacity, width))
        padded.index_copy_(0, self.pad_index, x.index_select(0, self.rows))
        h = torch.bmm(padded.view(num_groups, self.capacity, width), a.index_select(0, self.keys).transpose(1, 2))
        y = torch.bmm(h, b.index_select(0, self.keys).transpose(1, 2))  # [G, C, out]
        out = x.new_zeros((self.num_rows, y.shape[-1]))
        return out.index_copy_(0, self.rows, y.view(-1, y.shape[-1]).index_select(0, self.pad_index))


class LoraSite:
    """The slot stacks of one linear site: `num_keys` slots of rank `max_rank` (fixed addresses)."""

    def __init__(self, num_keys: int, max_rank: int, in_features: int, out_features: int, dtype: torch.dtype):
        self.max_rank = max_rank
        self.a = torch.zeros((num_keys, max_rank, in_features), dtype=dtype)
        self.b = torch.zeros((num_keys, out_features, max_rank), dtype=dtype)

    def write(self, key: int, a: torch.Tensor, b: torch.Tensor, row0: int = 0, rank0: int = 0) -> None:
        """Factors of one adapter module: a [r, in], b [out, r] (scaling already in b), placed at
        output rows `row0:` and rank columns `rank0:` (fused sites: q|k|v, gate|up)."""
        r = a.shape[0]
        self.a[key, rank0 : rank0 + r].copy_(a)
        self.b[key, row0 : row0 + b.shape[0], rank0 : rank0 + r].copy_(b)

    def clear(self, key: int) -> None:
        self.a[key].zero_()
        self.b[key].zero_()
