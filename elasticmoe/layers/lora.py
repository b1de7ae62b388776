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

from dataclasses import dataclass, field

import torch

from elasticmoe.kernels.grouped_gemm import (
    grouped_expand,
    grouped_gemm,
    grouped_lora_add,
    has_grouped_gemm,
    slot_offsets,
)


@dataclass(frozen=True, slots=True)
class LoraGroups:
    """(row, adapter) pairs of a batch grouped by LoRA key (see the module docstring).

    A row may carry several keys with weights (learned top-k routing, MoLoRA eq. 8): its
    LoRA output is the weighted sum over its keys. Built once per forward for the attention sites
    and per MoE layer for the experts', so it holds only what the grouped kernel needs; the padded
    fallback's layout is made when it runs.
    """

    num_rows: int
    rows: torch.Tensor  # [P] the row of each pair, pairs grouped by key
    pair_keys: torch.Tensor  # [P] the key of each pair (ascending)
    weights: torch.Tensor | None  # [P] pair weights (None: all 1)
    # Every row has one pair: its output is its pair's (no sum over pairs, no row without one); and
    # the pairs are the rows in order (a batch of one adapter, an expert site's rows of one adapter)
    one_per_row: bool = False
    in_order: bool = False
    # `slot_offsets` of the pairs per number of keys: the sites of one build share them
    _offsets: dict[int, torch.Tensor] = field(default_factory=dict, compare=False, repr=False)
    # (keys, in features) of the sites `grouped_lora_add` left to the two kernels (their groups run
    # on panels: a one-adapter prefill or decode): later sites of the build go there directly
    _unfused: set[tuple[int, int]] = field(default_factory=set, compare=False, repr=False)

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
        per_row = flat.numel() // max(num_rows, 1)
        rows = torch.div(pairs, per_row, rounding_mode="floor") if keys.dim() == 2 else pairs
        pair_weights = weights.reshape(-1).index_select(0, pairs) if weights is not None else None
        if pair_weights is not None and bool((pair_weights == 1).all()):
            pair_weights = None  # each row's one adapter at full weight: nothing to scale
        # One pair per row: as many pairs as rows, all in the first column (the engine's keys have K
        # columns for learned routing, -1 beyond each row's own adapter when no router runs)
        one_per_row = pairs.numel() == num_rows and (keys.dim() == 1 or keys.shape[1] == 1
                                                     or not bool((keys[:, 1:] >= 0).any()))
        in_order = one_per_row and bool(torch.equal(rows, torch.arange(num_rows)))
        return cls(num_rows, rows, pair_keys, pair_weights, one_per_row, in_order)

    def offsets(self, num_keys: int) -> torch.Tensor:
        """The pairs' group bounds for `num_keys` keys ([num_keys + 1], see `slot_offsets`)."""
        found = self._offsets.get(num_keys)
        if found is None:
            found = self._offsets[num_keys] = slot_offsets(self.pair_keys, num_keys)
        return found

    def delta(self, x: torch.Tensor, a: torch.Tensor, bt: torch.Tensor) -> torch.Tensor:
        """x [N, in], a [K, r, in], bt [K, r, out] -> the rows' LoRA outputs [N, out] (0 without a key)."""
        return self._rows_out(x, self._pairs_out(x, self._pair_inputs(x), a, bt))

    def add_delta(self, y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, bt: torch.Tensor) -> torch.Tensor:
        """`y + delta(x, a, bt)`, the same values; in place in y (a fresh output of the site's
        linear) by one kernel call where each row has one adapter at full weight
        (`grouped_lora_add`: a mixed decode batch's site 42-58 -> 22-39 us), else a new tensor."""
        site = (a.shape[0], a.shape[2])
        if not (self.one_per_row and self.weights is None and site not in self._unfused
                and has_grouped_gemm(x.dtype, a.dtype)):
            return y + self.delta(x, a, bt)
        xs = self._pair_inputs(x)
        if grouped_lora_add(y, xs, None if self.in_order else self.rows, self.offsets(a.shape[0]), a, bt):
            return y
        self._unfused.add(site)
        return y + self._rows_out(x, self._pairs_out(x, xs, a, bt))

    def _pair_inputs(self, x: torch.Tensor) -> torch.Tensor:
        """The pairs' input rows, in pair order."""
        return x if self.in_order else x.index_select(0, self.rows)

    def _pairs_out(self, x: torch.Tensor, xs: torch.Tensor, a: torch.Tensor, bt: torch.Tensor) -> torch.Tensor:
        """Each pair's weighted LoRA output [P, out] (`xs`: `_pair_inputs(x)`)."""
        # The grouped kernel wherever it serves the dtypes. The padded bmm computes every group at the
        # largest group's size: a continuous batch's prefill of 128 rows beside 40 decodes of one row
        # (r 16, 512 -> 512, 2 threads, Zen 5) took 3.07 ms in bf16 and 7.82 ms in fp32 there, 0.11
        # and 0.13 ms grouped; 64 decodes of one row each 0.14 against 0.09 ms.
        pair_out = None
        if has_grouped_gemm(x.dtype, a.dtype):
            offsets = self.offsets(a.shape[0])
            pair_out = grouped_expand(grouped_gemm(xs, offsets, a), offsets, bt)
        if pair_out is None:
            pair_out = self._padded_delta(x, a, bt)
        if self.weights is not None:
            pair_out = pair_out * self.weights.unsqueeze(1).to(pair_out.dtype)
        return pair_out

    def _rows_out(self, x: torch.Tensor, pair_out: torch.Tensor) -> torch.Tensor:
        """The pairs' outputs summed into their rows [N, out] (0 without a key)."""
        if self.in_order:
            return pair_out
        if self.one_per_row:  # a permutation of the rows: each written once, nothing to zero or sum
            return x.new_empty((self.num_rows, pair_out.shape[-1])).index_copy_(0, self.rows, pair_out)
        return x.new_zeros((self.num_rows, pair_out.shape[-1])).index_add_(0, self.rows, pair_out)

    def _padded_delta(self, x: torch.Tensor, a: torch.Tensor, bt: torch.Tensor) -> torch.Tensor:
        """Each pair's LoRA output [P, out], by batched GEMMs over groups padded to the largest."""
        used, counts = torch.unique_consecutive(self.pair_keys, return_counts=True)  # [G] keys, their pairs
        num_groups, capacity, width = used.numel(), int(counts.max()), x.shape[1]
        group = torch.repeat_interleave(torch.arange(num_groups), counts)
        starts = torch.cumsum(counts, 0) - counts
        pad_index = group * capacity + torch.arange(self.pair_keys.numel()) - starts.index_select(0, group)
        padded = x.new_zeros((num_groups * capacity, width))
        padded.index_copy_(0, pad_index, x.index_select(0, self.rows))
        h = torch.bmm(padded.view(num_groups, capacity, width), a.index_select(0, used).transpose(1, 2))
        y = torch.bmm(h, bt.index_select(0, used))  # [G, C, out]
        return y.view(-1, y.shape[-1]).index_select(0, pad_index)


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
