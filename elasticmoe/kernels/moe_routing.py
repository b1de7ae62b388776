"""The bookkeeping around a MoE layer's experts, one kernel call each (csrc/moe_routing.cpp).

At decode sizes (tens of tokens) PyTorch's `topk`, `argsort`, `index_select`, `index_add_` and
friends each cost tens of microseconds of dispatch for a few hundred numbers; a decode step of an
8-layer model runs ~20 of them per layer. Each function returns None where the kernel does not
serve the case, and the caller's PyTorch path runs.
"""

from __future__ import annotations

import ctypes
from functools import cache
from typing import NamedTuple

import torch

from elasticmoe.kernels.build import declare, load_kernel, profiled

_DTYPE_CODE = {torch.float32: 0, torch.bfloat16: 1}
_MAX_TOPK = 64


@cache
def _library() -> ctypes.CDLL | None:
    lib = load_kernel("moe_routing")
    if lib is None:
        return None
    i64, ptr, c_int = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
    return declare(lib, {"emoe_topk": [ptr, i64, i64, i64, c_int, c_int, ptr, ptr],
                         "emoe_plan_pairs": [ptr, i64, c_int, ptr, i64, i64, ptr, ptr, ptr, ptr, ptr],
                         "emoe_combine": [ptr, i64, c_int, ptr, ptr, i64, c_int, i64, ptr, i64]})


def topk_probs(probs: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The `top_k` largest gate probabilities of each row of `probs` [T, E] (float32), largest first
    (equal values: lower expert id first), divided by their sum when `renormalize`:
    (weights [T, k] float32, expert ids [T, k] int64)."""
    lib = _library()
    if (lib is None or probs.dtype != torch.float32 or probs.dim() != 2 or probs.stride(-1) != 1
            or not 1 <= top_k <= min(probs.shape[1], _MAX_TOPK)):
        return None
    num_tokens = probs.shape[0]
    weights = torch.empty((num_tokens, top_k), dtype=torch.float32)
    ids = torch.empty((num_tokens, top_k), dtype=torch.int64)
    with profiled("emoe::topk"):
        rc = lib.emoe_topk(probs.data_ptr(), probs.stride(0), num_tokens, probs.shape[1], top_k, int(renormalize),
                           weights.data_ptr(), ids.data_ptr())
    return (weights, ids) if rc == 0 else None


class PairPlan(NamedTuple):
    """A layer's (token, expert) pairs grouped by expert slot: row i of the grouped order is pair
    `pair_of_row[i]` (= token * k + j), of token `token_of_row[i]`, run in slot `slot_of_row[i]`
    (ascending); pair p sits at row `row_of_pair[p]`; the rows of slot s are
    `offsets[s]:offsets[s + 1]`."""

    pair_of_row: torch.Tensor
    token_of_row: torch.Tensor
    slot_of_row: torch.Tensor
    row_of_pair: torch.Tensor
    offsets: torch.Tensor


def plan_pairs(topk_ids: torch.Tensor, expert_to_slot: torch.Tensor, num_slots: int) -> PairPlan | None:
    """Group the pairs of `topk_ids` [T, k] by the slot of their expert (`expert_to_slot` [E]), in
    pair order within a slot (as a stable argsort does). Raises ValueError for an id out of range."""
    lib = _library()
    if lib is None or topk_ids.dtype != torch.int64 or topk_ids.dim() != 2 or expert_to_slot.dtype != torch.int64:
        return None
    ids, table = topk_ids.contiguous(), expert_to_slot.contiguous()
    num_pairs = ids.numel()
    rows = torch.empty((4, num_pairs), dtype=torch.int64)
    offsets = torch.empty(num_slots + 1, dtype=torch.int64)
    with profiled("emoe::plan_pairs"):
        rc = lib.emoe_plan_pairs(ids.data_ptr(), ids.shape[0], ids.shape[1], table.data_ptr(), table.numel(), num_slots,
                                 *(r.data_ptr() for r in rows), offsets.data_ptr())
    if rc != 0:
        raise ValueError(f"expert ids: out of range for {table.numel()} experts / {num_slots} slots")
    return PairPlan(rows[0], rows[1], rows[2], rows[3], offsets)


def combine_pairs(pair_out: torch.Tensor, row_of_pair: torch.Tensor, weights: torch.Tensor) -> torch.Tensor | None:
    """out[t] = sum_j weights[t, j] * pair_out[row_of_pair[t * k + j]]: the experts' outputs of each
    token's k pairs (rows of `pair_out` [T * k, H]), weighted, in pair_out's dtype ([T, H])."""
    lib = _library()
    if lib is None or pair_out.dtype not in _DTYPE_CODE or pair_out.dim() != 2 or pair_out.stride(-1) != 1:
        return None
    num_tokens, top_k = weights.shape
    w = weights.to(torch.float32).contiguous()
    out = pair_out.new_empty((num_tokens, pair_out.shape[1]))
    with profiled("emoe::combine"):
        rc = lib.emoe_combine(pair_out.data_ptr(), pair_out.stride(0), _DTYPE_CODE[pair_out.dtype],
                              row_of_pair.data_ptr(), w.data_ptr(), num_tokens, top_k, pair_out.shape[1],
                              out.data_ptr(), out.stride(0))
    return out if rc == 0 else None
