"""`causal_attention`: prefill spans attending causally to their context, in one call.

A prefill of many short prompts is many small causal attentions, and a long prompt's later chunks
attend to the chunks before them. PyTorch's CPU paths for them run far below the machine's GEMM
rate (SDPA's flash kernel in fp32; batched matmuls, or SDPA with an explicit mask, that also
compute the masked part); `csrc/causal_attention.cpp` computes only the causal part, in register
tiles, reading q and the K/V rows where the projection, the step's new KV or the gathered blocks
left them.
"""

from __future__ import annotations

import ctypes
from functools import cache

import torch

from elasticmoe.kernels.build import declare, load_kernel, profiled

_DTYPE_CODE = {torch.float32: 0, torch.bfloat16: 1}


@cache
def _kernel() -> ctypes._CFuncPtr | None:  # type: ignore[name-defined]
    lib = load_kernel("causal_attention")
    if lib is None:
        return None
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    return declare(lib, {"emoe_causal_attention": [ptr, i64, i64, ptr, i64, i64, i64, i64, i64, i64, i64, i64,
                                                   ctypes.c_float, ctypes.c_int, ptr]}).emoe_causal_attention


def causal_attention(q: torch.Tensor, kv: torch.Tensor, scale: float) -> torch.Tensor | None:
    """q [S, Nq, H, D] (heads and D contiguous; any span and position strides); kv [S, Nk, 2, Hkv,
    D] with Nk >= Nq (K then V of each token, each token's contiguous) -> [S, Nq, H, D] in q's
    dtype. The queries are a span's last Nq positions: query i attends to keys 0..Nk - Nq + i (a
    whole prompt when Nk = Nq). None where the kernel does not serve the call (the caller's PyTorch
    path runs): no build, another dtype or layout, D not a multiple of the vector width."""
    fn = _kernel()
    if fn is None or q.dtype not in _DTYPE_CODE or kv.dtype != q.dtype or q.dim() != 4 or kv.dim() != 5:
        return None
    spans, num_queries, num_heads, head_dim = q.shape
    num_keys, num_kv_heads = kv.shape[1], kv.shape[3]
    if kv.shape[0] != spans or num_keys < num_queries or kv.shape[2] != 2 or kv.shape[4] != head_dim:
        return None
    if q.stride(3) != 1 or q.stride(2) != head_dim or kv.stride(4) != 1 or kv.stride(3) != head_dim:
        return None
    if kv.stride(2) != num_kv_heads * head_dim:
        return None
    out = q.new_empty(q.shape)
    with profiled("emoe::causal_attention"):
        rc = fn(q.data_ptr(), q.stride(0), q.stride(1), kv.data_ptr(), kv.stride(0), kv.stride(1), spans,
                num_queries, num_keys, num_heads, num_kv_heads, head_dim, scale, _DTYPE_CODE[q.dtype], out.data_ptr())
    return out if rc == 0 else None
