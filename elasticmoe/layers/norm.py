from __future__ import annotations

import torch

from elasticmoe.kernels.rms_norm import fused_rms_norm


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
