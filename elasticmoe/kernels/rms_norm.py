"""`fused_rms_norm`: RMSNorm of rows in one call (PyTorch's composite takes eight ops per norm)."""

from __future__ import annotations

import ctypes
from functools import cache

import torch

from elasticmoe.kernels.build import load_kernel

_DTYPE_CODE = {torch.float32: 0, torch.bfloat16: 1}
_SUPPORTED = {(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16), (torch.float32, torch.bfloat16)}


@cache
def _kernel() -> ctypes._CFuncPtr | None:  # type: ignore[name-defined]
    lib = load_kernel("rms_norm")
    if lib is None:
        return None
    fn = lib.emoe_rms_norm
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    fn.argtypes = [ptr, i64, ctypes.c_int, ptr, ctypes.c_int, ptr, i64, i64, ctypes.c_float]
    fn.restype = ctypes.c_int
    return fn


def fused_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor | None:
    """x [..., C] whose rows have one stride, weight [C] -> normed [..., C]; None when the kernel
    does not serve this case (the caller's PyTorch path runs)."""
    if (x.dtype, weight.dtype) not in _SUPPORTED or weight.dim() != 1 or x.stride(-1) != 1:
        return None
    rows = x if x.dim() == 2 else (x.view(-1, x.shape[-1]) if x.is_contiguous() else None)
    fn = _kernel()
    if fn is None or rows is None or not weight.is_contiguous():
        return None
    out = torch.empty(rows.shape, dtype=x.dtype)
    rc = fn(rows.data_ptr(), rows.stride(0), _DTYPE_CODE[x.dtype], weight.data_ptr(), _DTYPE_CODE[weight.dtype],
            out.data_ptr(), rows.shape[0], rows.shape[1], eps)
    return out.view(x.shape) if rc == 0 else None
