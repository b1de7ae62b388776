"""`fused_rms_norm`: RMSNorm of rows in one call (PyTorch's composite takes eight ops per norm);
`fused_add_rms_norm`: the residual add and the next norm in one pass."""

from __future__ import annotations

import ctypes
from functools import cache

import torch

from elasticmoe.kernels.build import declare, load_kernel

_DTYPE_CODE = {torch.float32: 0, torch.bfloat16: 1}
_SUPPORTED = {(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16), (torch.float32, torch.bfloat16)}


@cache
def _library() -> ctypes.CDLL | None:
    lib = load_kernel("rms_norm")
    if lib is None:
        return None
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    c_int, c_float = ctypes.c_int, ctypes.c_float
    return declare(lib, {"emoe_rms_norm": [ptr, i64, i64, c_int, ptr, c_int, ptr, i64, i64, i64, c_float],
                         "emoe_add_rms_norm": [ptr, i64, ptr, i64, c_int, ptr, c_int, ptr, i64, ptr, i64, i64, i64,
                                               c_float]})


def _kernel() -> ctypes._CFuncPtr | None:  # type: ignore[name-defined]
    lib = _library()
    return lib.emoe_rms_norm if lib is not None else None


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


def fused_add_rms_norm(h: torch.Tensor, y: torch.Tensor, weight: torch.Tensor,
                       eps: float) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(h + y, rms_norm(h + y)) for h, y [R, C] (unit column stride) of one dtype, in one pass: the
    sum rounded to h's dtype as PyTorch's add rounds it, the norm as `fused_rms_norm`. New tensors;
    h and y are left as they are. None where the kernel does not serve the case."""
    lib = _library() if (h.dtype, weight.dtype) in _SUPPORTED else None
    if (lib is None or y.dtype != h.dtype or h.dim() != 2 or y.shape != h.shape or h.stride(-1) != 1
            or y.stride(-1) != 1 or weight.dim() != 1 or not weight.is_contiguous() or weight.shape[0] != h.shape[1]):
        return None
    total, normed = torch.empty(h.shape, dtype=h.dtype), torch.empty(h.shape, dtype=h.dtype)
    rc = lib.emoe_add_rms_norm(h.data_ptr(), h.stride(0), y.data_ptr(), y.stride(0), _DTYPE_CODE[h.dtype],
                               weight.data_ptr(), _DTYPE_CODE[weight.dtype], total.data_ptr(), total.stride(0),
                               normed.data_ptr(), normed.stride(0), h.shape[0], h.shape[1], eps)
    return (total, normed) if rc == 0 else None
