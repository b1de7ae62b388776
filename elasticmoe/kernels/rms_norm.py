"""`fused_rms_norm`: RMSNorm of rows in one call (PyTorch's composite takes eight ops per norm)."""

from __future__ import annotations

import ctypes
from functools import cache

import torch

from elasticmoe.kernels.build import declare, load_kernel

_DTYPE_CODE = {torch.float32: 0, torch.bfloat16: 1}
_SUPPORTED = {(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16), (torch.float32, torch.bfloat16)}


@cache
def _kernel() -> ctypes._CFuncPtr | None:  # type: ignore[name-defined]
    lib = load_kernel("rms_norm")
    if lib is None:
        return None
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    return declare(lib, {"emoe_rms_norm": [ptr, i64, i64, ctypes.c_int, ptr, ctypes.c_int, ptr, i64, i64, i64,
                                           ctypes.c_float]}).emoe_rms_norm


def _layout(t: torch.Tensor) -> tuple[int, int] | None:
    """(outer stride, rows per group) of [R, C] or [T, G, C] whose groups of rows are contiguous."""
    if t.stride(-1) != 1:
        return None
    if t.dim() == 2:
        return t.stride(0), 1
    if t.dim() == 3 and (t.shape[1] == 1 or t.stride(1) == t.shape[2]):
        return t.stride(0), t.shape[1]
    return None


def fused_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
                   out: torch.Tensor | None = None) -> torch.Tensor | None:
    """x [R, C] or [T, G, C] (rows of a group contiguous, any outer stride), weight [C] -> normed,
    into `out` (same shape, same layout rule) or a new tensor; None when the kernel does not serve
    this case (the caller's PyTorch path runs)."""
    if (x.dtype, weight.dtype) not in _SUPPORTED or weight.dim() != 1 or not weight.is_contiguous():
        return None
    fn = _kernel()
    out = torch.empty(x.shape, dtype=x.dtype) if out is None else out
    x_layout, out_layout = _layout(x), _layout(out)
    if fn is None or x_layout is None or out_layout is None or out.dtype != x.dtype or out.shape != x.shape:
        return None
    rows = x.numel() // x.shape[-1]
    rc = fn(x.data_ptr(), x_layout[0], x_layout[1], _DTYPE_CODE[x.dtype], weight.data_ptr(), _DTYPE_CODE[weight.dtype],
            out.data_ptr(), out_layout[0], rows, x.shape[-1], eps)
    return out if rc == 0 else None
