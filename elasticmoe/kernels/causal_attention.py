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
    return declare(lib, {"emoe_causal_attention": [ptr, i64, i64, ptr, i64, i64, i64, ptr, i64, i64, i64, i64, i64,
                                                   i64, i64, i64, i64, i64, ctypes.c_float, ctypes.c_int,
                                                   ptr]}).emoe_causal_attention


def available() -> bool:
    """Whether the kernel is built for this CPU (else every call declines)."""
    return _kernel() is not None


def causal_attention(q: torch.Tensor, kv: torch.Tensor, scale: float) -> torch.Tensor | None:
    """GQA caches: q [S, Nq, H, D] (heads and D contiguous; any span and position strides); kv [S,
    Nk, 2, Hkv, D] with Nk >= Nq (K then V of each token, as the paged cache holds them) -> [S, Nq,
    H, D] in q's dtype. The queries are a span's last Nq positions: query i attends to keys 0..Nk -
    Nq + i (a whole prompt when Nk = Nq). None where the kernel does not serve the call (the
    caller's PyTorch path runs): no build, another dtype or layout, D not a multiple of the vector
    width."""
    if kv.dim() != 5 or kv.shape[2] != 2:
        return None
    return causal_attention_kv(q, kv[:, :, 0], kv[:, :, 1], scale)


def causal_attention_kv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor | None:
    """As `causal_attention`, with the keys and values apart and of their own widths: q [S, Nq, H,
    Dk] (heads Dk apart), k [S, Nk, Hkv, Dk], v [S, Nk, Hkv, Dv] (each head contiguous; any span,
    token and head strides) -> [S, Nq, H, Dv] (an MLA layer's keys and values, expanded from its
    latents)."""
    fn = _kernel()
    if fn is None or q.dtype not in _DTYPE_CODE or k.dtype != q.dtype or v.dtype != q.dtype:
        return None
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        return None
    spans, num_queries, num_heads, key_dim = q.shape
    num_keys, num_kv_heads, value_dim = k.shape[1], k.shape[2], v.shape[3]
    if k.shape != (spans, num_keys, num_kv_heads, key_dim) or v.shape[:3] != k.shape[:3] or num_keys < num_queries:
        return None
    if q.stride(3) != 1 or q.stride(2) != key_dim or k.stride(3) != 1 or v.stride(3) != 1:
        return None
    out = q.new_empty((spans, num_queries, num_heads, value_dim))
    with profiled("emoe::causal_attention"):
        rc = fn(q.data_ptr(), q.stride(0), q.stride(1), k.data_ptr(), k.stride(0), k.stride(1), k.stride(2),
                v.data_ptr(), v.stride(0), v.stride(1), v.stride(2), spans, num_queries, num_keys, num_heads,
                num_kv_heads, key_dim, value_dim, scale, _DTYPE_CODE[q.dtype], out.data_ptr())
    return out if rc == 0 else None
