"""`grouped_gemm(x, offsets, w)`: each group of rows of x times its slot's weight, in one call.

    out[r] = x[r] @ w[s].T   for offsets[s] <= r < offsets[s + 1]

One kernel for the experts of a MoE layer (base and ESFT adapter slots alike: a slot without
rows is never read) and for LoRA factors grouped by adapter, without padding every group to
the largest one. The weights are read where they are, in their `[S, out, in]` layout.
"""

from __future__ import annotations

import ctypes
import logging
from functools import cache

import torch
import torch.nn.functional as F

from elasticmoe.kernels.build import declare, load_kernel, profiled

logger = logging.getLogger(__name__)

_DTYPE_CODE = {torch.float32: 0, torch.bfloat16: 1}
# (activation, weight) pairs the kernel computes; the output has the activation's dtype.
_SUPPORTED = {(torch.float32, torch.float32), (torch.float32, torch.bfloat16), (torch.bfloat16, torch.bfloat16)}


_ARGTYPES: list = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int,
             ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int, ctypes.c_void_p, ctypes.c_int64,
             ctypes.c_int64, ctypes.c_int64]
# x, ldx, x dtype, rows, offsets, slots, a, its strides, bt, its strides, weight dtype, out, ldo, in, out, rank, h
_LORA_ADD_ARGTYPES: list = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int,
                            ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64,
                            ctypes.c_int64, ctypes.c_int, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64,
                            ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p]


@cache
def _library() -> ctypes.CDLL | None:
    lib = load_kernel("grouped_gemm")
    if lib is None:
        return None
    declare(lib, {"emoe_grouped_gemm": _ARGTYPES, "emoe_grouped_swiglu": _ARGTYPES, "emoe_grouped_expand": _ARGTYPES,
                  "emoe_grouped_lora_add": _LORA_ADD_ARGTYPES, "emoe_fuses_swiglu": [ctypes.c_int, ctypes.c_int]})
    granted = lib.emoe_amx_init()
    if granted == 0:
        logger.warning("kernels: the OS refused AMX tile state; the grouped GEMM runs on AVX-512")
    _amx_builds[lib._name] = granted == 1
    return lib


_amx_builds: dict[str, bool] = {}  # loaded library -> whether it computes on AMX tiles


def computes_on_amx() -> bool:
    """Whether the grouped kernel computes bf16 weights on AMX tiles here: then it also serves
    fp32 activations times bf16 weights faster than widening the weights for an fp32 GEMM."""
    lib = _library()
    return lib is not None and _amx_builds.get(lib._name, False)


def computes_fp32_with_bf16_weights() -> bool:
    """Whether the kernel multiplies fp32 activations by bf16 weights here, which every build does
    at least as fast as widening the weights for oneDNN's fp32 GEMM (AMX tiles; elsewhere the dot
    kernel and packed panels, widening in registers: Zen 3 AVX2, [64, 512] x [768, 512]^T 0.29 vs
    0.42 ms, [2048, 512] x [768, 512]^T 8.9 vs 10.0; Zen 5 AVX-512, 0.13 vs 0.20 ms and 3.6-3.7 ms
    both), so that bf16 weights computed in fp32 (a provider's shared memory) go to it at any size."""
    return _library() is not None


def _kernel() -> ctypes._CFuncPtr | None:  # type: ignore[name-defined]
    lib = _library()
    return lib.emoe_grouped_gemm if lib is not None else None


def has_grouped_gemm(x_dtype: torch.dtype, w_dtype: torch.dtype) -> bool:
    """Whether the compiled kernel serves this dtype pair on this host (else the PyTorch loop runs)."""
    return (x_dtype, w_dtype) in _SUPPORTED and _kernel() is not None


def slot_offsets(sorted_slots: torch.Tensor, num_slots: int) -> torch.Tensor:
    """First row of each slot, plus the end: [num_slots + 1] int64, for rows sorted by slot."""
    offsets = torch.zeros(num_slots + 1, dtype=torch.int64)
    torch.cumsum(torch.bincount(sorted_slots, minlength=num_slots), 0, out=offsets[1:])
    return offsets


def kernel_linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor | None:
    """x [M, in] @ w[out, in].T on the kernel's threads (decode-size projections while PyTorch
    runs one thread; fp32 x bf16 on AMX); None where the kernel does not serve it."""
    if x.dim() != 2 or (x.dtype, w.dtype) not in _SUPPORTED or w.stride(-1) != 1 or _kernel() is None:
        return None
    return grouped_gemm(x, _one_group(x.shape[0]), w.unsqueeze(0))


@cache
def _one_group(num_rows: int) -> torch.Tensor:
    """Offsets of a single group of `num_rows` rows (a decode step asks for the same few sizes)."""
    return torch.tensor([0, num_rows])


@cache
def _fuses_swiglu(lib: ctypes.CDLL, x_dtype: torch.dtype, w_dtype: torch.dtype) -> bool:
    """Whether this build fuses the SwiGLU for the pair (AMX: bf16 weights; AVX-512 with bf16 dot
    products: bf16 activations and weights; every build: fp32 activations):
    elsewhere the call declines before allocating anything."""
    return bool(lib.emoe_fuses_swiglu(_DTYPE_CODE[x_dtype], _DTYPE_CODE[w_dtype]))


def grouped_swiglu(x: torch.Tensor, offsets: torch.Tensor, w13: torch.Tensor,
                   slot_rows: torch.Tensor | None = None) -> torch.Tensor | None:
    """silu(x @ gate.T) * (x @ up.T) per group, with w13 [>= S, 2 * I, in] holding each slot's gate
    rows then its up rows: the expert MLP's first projection and activation in one pass ([N, I]
    in x's dtype). None where the kernel does not fuse it (AMX builds fuse bf16 weights with
    I % 16 == 0, AVX-512 builds with bf16 dot products bf16 activations and weights, every build
    fp32 activations): the caller runs `grouped_gemm` and the activation."""
    lib = _library() if (x.dtype, w13.dtype) in _SUPPORTED else None
    if lib is None or not _fuses_swiglu(lib, x.dtype, w13.dtype):
        return None
    if w13.stride(-1) != 1 or offsets.dtype != torch.int64 or w13.shape[1] % 2:
        return None
    inter = w13.shape[1] // 2
    out = x.new_empty((x.shape[0], inter))
    if x.shape[0] == 0:
        return out
    x = x if x.stride(-1) == 1 else x.contiguous()
    offsets = offsets.contiguous()
    rows = slot_rows.contiguous() if slot_rows is not None else None
    with profiled("emoe::grouped_swiglu"):
        rc = lib.emoe_grouped_swiglu(x.data_ptr(), x.stride(0), _DTYPE_CODE[x.dtype], offsets.data_ptr(),
                                     rows.data_ptr() if rows is not None else None, offsets.numel() - 1,
                                     w13.data_ptr(), w13.stride(0), w13.stride(1), _DTYPE_CODE[w13.dtype],
                                     out.data_ptr(), out.stride(0), inter, w13.shape[2])
    return out if rc == 0 else None


def grouped_expand(x: torch.Tensor, offsets: torch.Tensor, wt: torch.Tensor) -> torch.Tensor | None:
    """x [N, K] with rows grouped by slot (`offsets` [S + 1]), wt [>= S, K, out] (each slot's weights
    transposed, out contiguous) -> [N, out] in x's dtype: `x[r] @ wt[s]` per group. For a short K
    (LoRA's second projection, K = the rank) each output row is K vector FMAs over its columns, where
    `grouped_gemm`'s layout reduces every output over K (an expert site's decode call, 64 groups of 4
    rows, K = 16: 23 against 137-145 us; docs/adapters.md). None where the kernel does not serve the
    dtypes (the caller computes it otherwise)."""
    lib = _library() if (x.dtype, wt.dtype) in _SUPPORTED else None
    if lib is None or wt.stride(-1) != 1 or offsets.dtype != torch.int64:
        return None
    out = x.new_empty((x.shape[0], wt.shape[2]))
    if x.shape[0] == 0:
        return out
    x = x if x.stride(-1) == 1 else x.contiguous()
    offsets = offsets.contiguous()
    with profiled("emoe::grouped_expand"):
        rc = lib.emoe_grouped_expand(x.data_ptr(), x.stride(0), _DTYPE_CODE[x.dtype], offsets.data_ptr(), None,
                                     offsets.numel() - 1, wt.data_ptr(), wt.stride(0), wt.stride(1),
                                     _DTYPE_CODE[wt.dtype], out.data_ptr(), out.stride(0), wt.shape[2], wt.shape[1])
    return out if rc == 0 else None


def grouped_lora_add(out: torch.Tensor, x: torch.Tensor, rows: torch.Tensor | None, offsets: torch.Tensor,
                     a: torch.Tensor, bt: torch.Tensor) -> bool:
    """out[rows[p]] += (x[p] @ a[s].T) @ bt[s] for each pair p of group s (rows None: row p), in
    place, each product rounded to x's dtype as `grouped_gemm` and `grouped_expand` round them and
    the sum as PyTorch's `out + delta`: the values of those two calls and the add, in one parallel
    region (a mixed decode batch's LoRA site: 42-58 -> 22-39 us). No row may appear twice in
    `rows`. False, with `out` untouched, where the kernel leaves the call to those two (dtypes,
    layouts, a call `grouped_gemm` runs on panels or AMX tiles)."""
    lib = _library() if (x.dtype, a.dtype) in _SUPPORTED and bt.dtype == a.dtype and out.dtype == x.dtype else None
    if (lib is None or out.dim() != 2 or x.dim() != 2 or out.stride(-1) != 1 or x.stride(-1) != 1
            or a.stride(-1) != 1 or bt.stride(-1) != 1 or offsets.dtype != torch.int64
            or (rows is not None and rows.dtype != torch.int64)):
        return False
    if x.shape[0] == 0:
        return True
    rank = a.shape[1]
    h = x.new_empty((x.shape[0], rank))
    offsets = offsets.contiguous()
    rows = rows.contiguous() if rows is not None else None
    with profiled("emoe::grouped_lora_add"):
        rc = lib.emoe_grouped_lora_add(x.data_ptr(), x.stride(0), _DTYPE_CODE[x.dtype],
                                       rows.data_ptr() if rows is not None else None, offsets.data_ptr(),
                                       offsets.numel() - 1, a.data_ptr(), a.stride(0), a.stride(1), bt.data_ptr(),
                                       bt.stride(0), bt.stride(1), _DTYPE_CODE[a.dtype], out.data_ptr(),
                                       out.stride(0), a.shape[2], bt.shape[2], rank, h.data_ptr())
    return rc == 0


def grouped_gemm(x: torch.Tensor, offsets: torch.Tensor, w: torch.Tensor,
                 slot_rows: torch.Tensor | None = None) -> torch.Tensor:
    """x [N, in] with rows grouped by slot (`offsets` [S + 1], see `slot_offsets`), w [>= S, out, in]
    -> [N, out] in x's dtype. `slot_rows` [S] int64: slot s computes with `w[slot_rows[s]]`
    (an expert cache's pool rows) instead of `w[s]`."""
    num_slots = offsets.numel() - 1
    out = x.new_empty((x.shape[0], w.shape[1]))
    if x.shape[0] == 0:
        return out
    if slot_rows is not None and (slot_rows.dtype != torch.int64 or slot_rows.numel() != num_slots):
        raise ValueError(f"slot_rows: need {num_slots} int64 rows, got {slot_rows.numel()} {slot_rows.dtype}")
    fn = _kernel() if (x.dtype, w.dtype) in _SUPPORTED else None
    if fn is not None and w.stride(-1) == 1 and offsets.dtype == torch.int64:
        x = x if x.stride(-1) == 1 else x.contiguous()
        offsets = offsets.contiguous()
        rows = slot_rows.contiguous() if slot_rows is not None else None
        with profiled("emoe::grouped_gemm"):
            rc = fn(x.data_ptr(), x.stride(0), _DTYPE_CODE[x.dtype], offsets.data_ptr(),
                    rows.data_ptr() if rows is not None else None, num_slots,
                    w.data_ptr(), w.stride(0), w.stride(1), _DTYPE_CODE[w.dtype], out.data_ptr(), out.stride(0),
                    w.shape[1], w.shape[2])
        if rc == 0:
            return out
    bounds = offsets.tolist()
    rows_list = slot_rows.tolist() if slot_rows is not None else range(num_slots)
    for slot in range(num_slots):
        start, end = bounds[slot], bounds[slot + 1]
        if end > start:
            out[start:end] = F.linear(x[start:end], w[rows_list[slot]].to(x.dtype))
    return out
