"""Grouped expert computation over stacked weights.

`w13` is `[E_slots, 2 * I, H]` (gate and up projections stacked per expert),
`w2` is `[E_slots, H, I]`. A slot may hold a base expert or an adapter expert:
the computation does not care which.

The kernel: one grouped GEMM per projection (`elasticmoe.kernels.grouped_gemm`) over the
stacked weights as they are, reading only the slots that have rows (decode reads each busy
expert's weights once, at close to memory bandwidth; base and ESFT adapter slots run in the
same call). Where that kernel is not built (no compiler, `ELASTICMOE_KERNELS=0`, or an
unsupported dtype pair) two PyTorch paths remain, chosen per call:
- padded batched GEMM: rows are scattered into `[E_slots, C, H]` (C = the
  busiest slot's row count) and every slot runs in one `bmm`. Best for decode,
  where each expert sees a handful of rows and a per-expert loop is dominated
  by call overhead. It reads every slot's weights, so it is used only when most
  slots are busy.
- per-slot loop over the rows sorted by slot: best for prefill (many rows per
  expert, padding would waste work) and for sparse use of many slots.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

from elasticmoe.kernels.grouped_gemm import grouped_gemm, grouped_swiglu, has_grouped_gemm, slot_offsets
from elasticmoe.layers.linear import linear

# The grouped kernel up to this many rows per slot (default: always). Past ~48 rows per slot
# oneDNN's GEMM per slot is faster on a quiet machine (single thread, 256 rows per slot: 16 vs 22 ms
# per layer), but a whole prefill step only gains ~5%, and its ~160 OpenMP regions per layer (two
# GEMMs and the glue per expert) each stall when another process preempts one of our threads:
# two regions per layer keep a shared machine usable. Set ELASTICMOE_GROUPED_MAX_ROWS=48 to compare.
_KERNEL_MAX_ROWS_PER_SLOT = int(os.environ.get("ELASTICMOE_GROUPED_MAX_ROWS", "1000000000"))
# Padded bmm when rows per busy slot are at most this many and most slots are busy.
_BMM_MAX_ROWS_PER_SLOT = 48
_BMM_MIN_BUSY_FRACTION = 0.75


def swiglu_mlp(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    gate, up = linear(x, w13).chunk(2, dim=-1)
    return linear(F.silu(gate) * up, w2)


def use_grouped_kernel(num_rows: int, num_slots: int, x_dtype: torch.dtype, w_dtype: torch.dtype) -> bool:
    """The grouped kernel for `num_rows` rows over `num_slots` dense slots (no host sync needed)."""
    if not has_grouped_gemm(x_dtype, w_dtype):
        return False
    return x_dtype != w_dtype or num_rows <= _KERNEL_MAX_ROWS_PER_SLOT * num_slots  # mixed: kernel only


def _grouped_swiglu(xs: torch.Tensor, offsets: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                    slot_rows: torch.Tensor | None = None) -> torch.Tensor:
    h = grouped_swiglu(xs, offsets, w13, slot_rows)  # [N, I]; None where the kernel does not fuse it
    if h is None:
        gate, up = grouped_gemm(xs, offsets, w13, slot_rows).chunk(2, dim=-1)  # [N, I] each
        h = F.silu(gate) * up
    return grouped_gemm(h, offsets, w2, slot_rows)


def grouped_experts_at_slot_rows(xs: torch.Tensor, sorted_slots: torch.Tensor, slot_rows: torch.Tensor,
                                 w13: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    """Rows of xs [N, H] grouped by ascending `sorted_slots`, slot s computing with weight row
    `slot_rows[s]` (`slot_rows` [S] int64, any order: an expert cache's pool rows) -> expert outputs
    [N, H] (unweighted)."""
    return _grouped_swiglu(xs, slot_offsets(sorted_slots, slot_rows.numel()), w13, w2, slot_rows)


def grouped_experts_at_rows(xs: torch.Tensor, offsets: torch.Tensor, rows: torch.Tensor, w13: torch.Tensor,
                            w2: torch.Tensor) -> torch.Tensor | None:
    """Rows of xs [N, H] in groups (group g is rows `offsets[g]:offsets[g + 1]`, `offsets` [G + 1]
    int64 from 0 to N), group g computing with weight row `rows[g]` (any order: an expert cache's
    pool rows) -> expert outputs [N, H] (unweighted), in one grouped kernel call per projection.
    None where the kernel does not serve it (the caller sorts the rows by weight row and calls
    `grouped_experts_sorted`)."""
    if not use_grouped_kernel(xs.shape[0], rows.numel(), xs.dtype, w13.dtype):
        return None
    return _grouped_swiglu(xs, offsets, w13, w2, rows)


def _padded_bmm(xs: torch.Tensor, sorted_slots: torch.Tensor, counts: torch.Tensor, max_count: int,
                w13: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    num_slots, hidden = w13.shape[0], xs.shape[1]
    starts = torch.cumsum(counts, 0) - counts  # [E] first sorted row of each slot
    rank_in_slot = torch.arange(xs.shape[0]) - starts.index_select(0, sorted_slots)  # [N]
    padded_rows = sorted_slots * max_count + rank_in_slot  # row of each input in the [E * C, H] buffer
    padded = xs.new_zeros((num_slots * max_count, hidden)).index_copy_(0, padded_rows, xs)
    w13, w2 = w13.to(xs.dtype), w2.to(xs.dtype)  # no-ops unless bf16 storage is computed in fp32
    gate, up = torch.bmm(padded.view(num_slots, max_count, hidden), w13.transpose(1, 2)).chunk(2, dim=-1)
    out = torch.bmm(F.silu(gate) * up, w2.transpose(1, 2))  # [E, C, H]
    return out.view(-1, hidden).index_select(0, padded_rows)


def grouped_experts_sorted(xs: torch.Tensor, sorted_slots: torch.Tensor, w13: torch.Tensor,
                           w2: torch.Tensor, dense_slots: int | None = None) -> torch.Tensor:
    """Rows of xs [N, H] grouped by ascending `sorted_slots` [N] -> expert outputs [N, H] (unweighted).

    `dense_slots`: only slots below it are sure to hold weights (a virtual weight tensor whose
    ESFT adapter slots are mapped sparsely); the grouped kernel reads busy slots only, the
    padded bmm never reads past them, and there rows of adapter slots (sorted last) run per slot.
    """
    if xs.shape[0] == 0:
        return xs.new_empty(xs.shape)
    if use_grouped_kernel(xs.shape[0], dense_slots or w13.shape[0], xs.dtype, w13.dtype):
        return _grouped_swiglu(xs, slot_offsets(sorted_slots, w13.shape[0]), w13, w2)
    if dense_slots is not None and dense_slots < w13.shape[0]:
        num_dense_rows = int(torch.searchsorted(sorted_slots, dense_slots))
        if num_dense_rows == xs.shape[0]:
            return grouped_experts_sorted(xs, sorted_slots, w13[:dense_slots], w2[:dense_slots])
        ys = torch.empty_like(xs)
        if num_dense_rows:
            ys[:num_dense_rows] = grouped_experts_sorted(
                xs[:num_dense_rows], sorted_slots[:num_dense_rows], w13[:dense_slots], w2[:dense_slots]
            )
        slots, counts = torch.unique_consecutive(sorted_slots[num_dense_rows:], return_counts=True)
        start = num_dense_rows
        for slot, n in zip(slots.tolist(), counts.tolist(), strict=True):
            ys[start : start + n] = swiglu_mlp(xs[start : start + n], w13[slot], w2[slot])
            start += n
        return ys
    num_slots = w13.shape[0]
    counts = torch.bincount(sorted_slots, minlength=num_slots)
    counts_list = counts.tolist()  # one host sync per layer
    max_count = max(counts_list)
    num_busy = sum(1 for n in counts_list if n)
    if max_count <= _BMM_MAX_ROWS_PER_SLOT and num_busy >= _BMM_MIN_BUSY_FRACTION * num_slots:
        return _padded_bmm(xs, sorted_slots, counts, max_count, w13, w2)
    ys = torch.empty_like(xs)
    start = 0
    for slot, n in enumerate(counts_list):
        if n:
            ys[start : start + n] = swiglu_mlp(xs[start : start + n], w13[slot], w2[slot])
            start += n
    return ys


def expert_rows_linear(xs: torch.Tensor, sorted_slots: torch.Tensor, w: torch.Tensor,
                       dense_slots: int | None = None, slot_rows: torch.Tensor | None = None) -> torch.Tensor:
    """Rows of xs [N, in] grouped by ascending `sorted_slots` -> `xs[i] @ w[slot_i].T` [N, out].
    `slot_rows` [S] int64: slot s computes with `w[slot_rows[s]]` instead (an expert cache's pool
    rows, in any order)."""
    if slot_rows is not None:
        return grouped_gemm(xs, slot_offsets(sorted_slots, slot_rows.numel()), w, slot_rows)
    if use_grouped_kernel(xs.shape[0], dense_slots or w.shape[0], xs.dtype, w.dtype):
        return grouped_gemm(xs, slot_offsets(sorted_slots, w.shape[0]), w)
    out = xs.new_empty((xs.shape[0], w.shape[1]))
    slots, counts = torch.unique_consecutive(sorted_slots, return_counts=True)
    start = 0
    for slot, n in zip(slots.tolist(), counts.tolist(), strict=True):
        out[start : start + n] = linear(xs[start : start + n], w[slot])
        start += n
    return out


def grouped_experts(x: torch.Tensor, slot_ids: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    """Run each row of x [N, H] through the expert in `slot_ids` [N]; returns [N, H] in input order."""
    order = torch.argsort(slot_ids, stable=True)
    ys = grouped_experts_sorted(x.index_select(0, order), slot_ids.index_select(0, order), w13, w2)
    return torch.empty_like(ys).index_copy_(0, order, ys)
