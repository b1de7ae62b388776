"""`paged_decode_attention`: one query per sequence against its paged KV blocks, read in place.

Replaces gathering each sequence's blocks into a padded `[B, K_max, ...]` copy (then two more
contiguous copies of K and V) before two small batched matmuls: at decode batch sizes those
copies cost as much as the attention itself.
"""

from __future__ import annotations

import ctypes
from functools import cache

import torch

from elasticmoe.kernels.build import declare, load_kernel, profiled

_DTYPE_CODE = {torch.float32: 0, torch.bfloat16: 1}


@cache
def _kernel() -> ctypes._CFuncPtr | None:  # type: ignore[name-defined]
    lib = load_kernel("paged_attention")
    if lib is None:
        return None
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    return declare(lib, {"emoe_paged_decode_attention": [ptr, i64, ptr, ptr, i64, ptr, i64, i64, i64, i64, i64,
                                                         ctypes.c_float, ctypes.c_int, ptr]}).emoe_paged_decode_attention


def paged_decode_attention(q: torch.Tensor, cache: torch.Tensor, block_table: torch.Tensor,
                           context_lens: torch.Tensor, block_size: int, scale: float) -> torch.Tensor | None:
    """q [B, H, D] (any row stride); cache [num_slots, 2, Hkv, D] (K and V of each token slot);
    block_table [B, max_blocks], context_lens [B] (int64) -> [B, H, D] in q's dtype.
    None when the kernel does not serve this case (the caller's PyTorch path runs)."""
    fn = _kernel()
    if fn is None or q.dtype not in _DTYPE_CODE or cache.dtype != q.dtype or cache.dim() != 4:
        return None
    if q.stride(2) != 1 or q.stride(1) != q.shape[2] or not cache.is_contiguous():
        return None
    batch, num_heads, head_dim = q.shape
    num_kv_heads = cache.shape[2]
    table = block_table.to(torch.int64).contiguous()
    lens = context_lens.to(torch.int64).contiguous()
    out = q.new_empty((batch, num_heads, head_dim))
    with profiled("emoe::paged_decode_attention"):
        rc = fn(q.data_ptr(), q.stride(0), cache.data_ptr(), table.data_ptr(), table.shape[1], lens.data_ptr(),
                batch, num_heads, num_kv_heads, head_dim, block_size, scale, _DTYPE_CODE[q.dtype], out.data_ptr())
    return out if rc == 0 else None
