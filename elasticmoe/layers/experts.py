"""Grouped expert computation over stacked weights.

`w13` is `[E_slots, 2 * I, H]` (gate and up projections stacked per expert),
`w2` is `[E_slots, H, I]`. A slot may hold a base expert or an adapter expert:
the computation does not care which.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def swiglu_mlp(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    gate, up = F.linear(x, w13).chunk(2, dim=-1)
    return F.linear(F.silu(gate) * up, w2)


def grouped_experts(x: torch.Tensor, slot_ids: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    """Run each row of x [N, H] through the expert in `slot_ids` [N]; returns [N, H] (unweighted)."""
    if x.shape[0] == 0:
        return x.new_empty(x.shape)
    order = torch.argsort(slot_ids, stable=True)
    counts = torch.bincount(slot_ids, minlength=w13.shape[0]).tolist()  # one host sync per layer
    xs = x[order]
    ys = torch.empty_like(xs)
    start = 0
    for slot, n in enumerate(counts):
        if n:
            ys[start : start + n] = swiglu_mlp(xs[start : start + n], w13[slot], w2[slot])
            start += n
    out = torch.empty_like(ys)
    out[order] = ys
    return out
