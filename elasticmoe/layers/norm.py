from __future__ import annotations

import torch

from elasticmoe.kernels.rms_norm import fused_add_rms_norm, fused_rms_norm


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm computed in float32, scaled in the input dtype (as HF Qwen3/Mixtral/DeepSeek do).

    One fused kernel call where it applies (rows of one stride, one weight vector), else the
    PyTorch ops (e.g. the per-head q/k norm over a strided view)."""
    fused = fused_rms_norm(x, weight, eps) if x.numel() else None
    if fused is not None:
        return fused
    dtype = x.dtype
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(dtype)


def add_rms_norm(h: torch.Tensor, y: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(h + y, rms_norm(h + y)): a residual add and the norm after it, in one kernel pass where it
    applies (a decode step makes two per layer: each a PyTorch op less and a memory pass less)."""
    fused = fused_add_rms_norm(h, y, weight, eps) if h.numel() else None
    if fused is not None:
        return fused
    total = h + y
    return total, rms_norm(total, weight, eps)
