"""`fused_rotary`: rotary position embeddings of a step's heads in one call (csrc/rotary.cpp)."""

from __future__ import annotations

import ctypes
from functools import cache

import torch

from elasticmoe.kernels.build import declare, load_kernel

_DTYPE_CODE = {torch.float32: 0, torch.bfloat16: 1}


@cache
def _kernel() -> ctypes._CFuncPtr | None:  # type: ignore[name-defined]
    lib = load_kernel("rotary")
    if lib is None:
        return None
    i64, ptr, c_int = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
    return declare(lib, {"emoe_rotary": [ptr, i64, c_int, i64, i64, i64, ptr, i64, ptr, ptr, c_int, ptr]}).emoe_rotary


def fused_rotary(x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                 interleaved: bool) -> torch.Tensor | None:
    """x [T, heads, d] (heads contiguous, any token stride) rotated by the tables' rows at
    `positions` [T] int64 -> a new [T, heads, d] in x's dtype. Half rotation: cos, sin [P, d] in x's
    dtype (`RotaryEmbedding`'s folded tables); interleaved: [P, d / 2] float32. None where the
    kernel does not serve the case, a position is outside the tables included (the caller's PyTorch
    path runs, and raises for the latter)."""
    table_dtype = torch.float32 if interleaved else x.dtype
    if (x.dtype not in _DTYPE_CODE or x.dim() != 3 or x.stride(-1) != 1 or x.stride(1) != x.shape[2]
            or positions.dtype != torch.int64 or positions.dim() != 1 or positions.shape[0] != x.shape[0]
            or cos.dtype != table_dtype or sin.dtype != table_dtype or not cos.is_contiguous()
            or not sin.is_contiguous() or cos.shape != sin.shape
            or cos.shape[-1] != (x.shape[2] // 2 if interleaved else x.shape[2])):
        return None
    fn = _kernel()
    if fn is None:
        return None
    positions = positions.contiguous()
    out = torch.empty(x.shape, dtype=x.dtype)
    rc = fn(x.data_ptr(), x.stride(0), _DTYPE_CODE[x.dtype], x.shape[0], x.shape[1], x.shape[2], positions.data_ptr(),
            cos.shape[0], cos.data_ptr(), sin.data_ptr(), int(interleaved), out.data_ptr())
    return out if rc == 0 else None
