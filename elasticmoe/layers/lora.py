"""Batched LoRA for a mixed batch (S-LoRA/Punica style, MoLoRA §5): one computation per site.

Every LoRA site (a linear layer some adapter may target) keeps its adapters' factors in
fixed slots: `A [K, r_max, in]` and B transposed, `Bt [K, r_max, out]` (the scaling folded into it;
ranks below r_max zero-padded). Each row of the batch carries a key (its adapter's slot, or
for expert sites slot * E + expert; -1: no adapter). `LoraGroups` groups the rows by key
once per forward; `delta` then runs two grouped GEMMs over the groups, whatever mix of adapters
the batch holds: no per-adapter pass, no per-token loop. That is the grouped kernel
(`elasticmoe.kernels.grouped_gemm`: each group's rows times its slot's factors, read in place, no
group padded to the largest one: MoLoRA's adaptive tiling; B's product in `grouped_expand`, whose
transposed layout makes the short rank a loop of vector FMAs instead of a reduction per output);
where it is not built, two batched GEMMs over groups padded to the largest (`[G, C, in] x
[G, in, r] -> [G, C, r] x [G, r, out]`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from elasticmoe.kernels.grouped_gemm import grouped_expand, grouped_gemm, has_grouped_gemm, slot_offsets


@dataclass(frozen=True, slots=True)
class LoraGroups:
    """(row, adapter) pairs of a batch grouped by LoRA key (see the module docstring).

    A row may carry several keys with weights (learned top-k routing, MoLoRA eq. 8): its
    LoRA output is the weighted sum over its keys.
    """

    num_rows: int
    rows: torch.Tensor  # [P] the row of each pair, pairs grouped by key
    keys: torch.Tensor  # [G] the distinct keys, ascending
    pad_index: torch.Tensor  # [P] where each pair sits in the padded [G * C] buffer
    capacity: int  # C
    weights: torch.Tensor | None  # [P] pair weights (None: all 1)
    pair_keys: torch.Tensor  # [P] the key of each pair (ascending)
    # Every row has one pair: its output is its pair's (no sum over pairs, no row without one); and
    # the pairs are the rows in order (a batch of one adapter, an expert site's rows of one adapter)
    one_per_row: bool = False
    in_order: bool = False

    @classmethod
    def build(cls, keys: torch.Tensor, weights: torch.Tensor | None = None) -> LoraGroups | None:
        """Groups of `keys` [N] or [N, k] (-1: none) with optional `weights` of the same shape;
        None if no row has a key."""
        num_rows = keys.shape[0]
        flat = keys.reshape(-1)
        pairs = torch.nonzero(flat >= 0).flatten()
        if pairs.numel() == 0:
            return None
        pair_keys = flat.index_select(0, pairs)
        order = torch.argsort(pair_keys, stable=True)
        pairs, pair_keys = pairs.index_select(0, order), pair_keys.index_select(0, order)
        used, counts = torch.unique_consecutive(pair_keys, return_counts=True)
        capacity = int(counts.max())
        starts = torch.cumsum(counts, 0) - counts
        group = torch.repeat_interleave(torch.arange(used.numel()), counts)
        rank_in_group = torch.arange(pairs.numel()) - starts.index_select(0, group)
        per_row = flat.numel() // max(num_rows, 1)
        rows = torch.div(pairs, per_row, rounding_mode="floor") if keys.dim() == 2 else pairs
        pair_weights = weights.reshape(-1).index_select(0, pairs) if weights is not None else None
        if pair_weights is not None and bool((pair_weights == 1).all()):
            pair_weights = None  # each row's one adapter at full weight: nothing to scale
        one_per_row = pairs.numel() == num_rows and (keys.dim() == 1 or keys.shape[1] == 1)
        in_order = one_per_row and bool(torch.equal(rows, torch.arange(num_rows)))
        return cls(num_rows, rows, used, group * capacity + rank_in_group, capacity, pair_weights, pair_keys,
                   one_per_row, in_order)

    def delta(self, x: torch.Tensor, a: torch.Tensor, bt: torch.Tensor) -> torch.Tensor:
        """x [N, in], a [K, r, in], bt [K, r, out] -> the rows' LoRA outputs [N, out] (0 without a key)."""
        # The grouped kernel wherever it serves the dtypes. The padded bmm computes every group at the
        # largest group's size: a continuous batch's prefill of 128 rows beside 40 decodes of one row
        # (r 16, 512 -> 512, 2 threads, Zen 5) took 3.07 ms in bf16 and 7.82 ms in fp32 there, 0.11
        # and 0.13 ms grouped; 64 decodes of one row each 0.14 against 0.09 ms.
        pair_out = None
        if has_grouped_gemm(x.dtype, a.dtype):
            offsets = slot_offsets(self.pair_keys, a.shape[0])
            pair_out = grouped_expand(grouped_gemm(x.index_select(0, self.rows), offsets, a), offsets, bt)
        if pair_out is None:
            pair_out = self._padded_delta(x, a, bt)
        if self.weights is not None:
            pair_out = pair_out * self.weights.unsqueeze(1).to(pair_out.dtype)
        if self.in_order:
            return pair_out
        if self.one_per_row:  # a permutation of the rows: each written once, nothing to zero or sum
            return x.new_empty((self.num_rows, pair_out.shape[-1])).index_copy_(0, self.rows, pair_out)
        return x.new_zeros((self.num_rows, pair_out.shape[-1])).index_add_(0, self.rows, pair_out)

    def _padded_delta(self, x: torch.Tensor, a: torch.Tensor, bt: torch.Tensor) -> torch.Tensor:
        """Each pair's LoRA output [P, out], by batched GEMMs over groups padded to the largest."""
        num_groups, width = self.keys.numel(), x.shape[1]
        padded = x.new_zeros((num_groups * self.capacity, width))
        padded.index_copy_(0, self.pad_index, x.index_select(0, self.rows))
        h = torch.bmm(padded.view(num_groups, self.capacity, width), a.index_select(0, self.keys).transpose(1, 2))
        y = torch.bmm(h, bt.index_select(0, self.keys))  # [G, C, out]
        return y.view(-1, y.shape[-1]).index_select(0, self.pad_index)


class LoraSite:
    """The slot stacks of one linear site: `num_keys` slots of rank `max_rank` (fixed addresses)."""

    def __init__(self, num_keys: int, max_rank: int, in_features: int, out_features: int, dtype: torch.dtype):
        self.max_rank = max_rank
        self.a = torch.zeros((num_keys, max_rank, in_features), dtype=dtype)
        self.bt = torch.zeros((num_keys, max_rank, out_features), dtype=dtype)  # B transposed (see the module doc)

    def write(self, key: int, a: torch.Tensor, b: torch.Tensor, row0: int = 0, rank0: int = 0) -> None:
        """Factors of one adapter module: a [r, in], b [out, r] (scaling already in b), placed at
        output rows `row0:` and rank columns `rank0:` (fused sites: q|k|v, gate|up)."""
        r = a.shape[0]
        self.a[key, rank0 : rank0 + r].copy_(a)
        self.bt[key, rank0 : rank0 + r, row0 : row0 + b.shape[0]].copy_(b.T)

    def clear(self, key: int, num_keys: int = 1) -> None:
        """Zero keys [key, key + num_keys) (one op per factor: a slot's experts are consecutive keys)."""
        self.a[key : key + num_keys].zero_()
        self.bt[key : key + num_keys].zero_()
