"""`linear(x, w)`: F.linear, with float32 routed to oneDNN.

PyTorch's float32 CPU matmul goes to MKL, which on the AMD EPYC machines this
project runs on measured 2.3x slower than oneDNN's kernel for the same shapes
([2048, 512] x [512, 1536]: 18.1 ms vs 7.8 ms). bfloat16 already goes to oneDNN.
Results agree to float32 rounding (max abs diff ~1e-6 relative).

While a decode step runs PyTorch on one thread (`ModelRunner`), projections of up to
`SMALL_ROWS` rows go to the grouped kernel, which keeps every core (`kernels.grouped_gemm`).

A weight stored in another dtype than x (bf16 weights computed in float32: from a shared-memory
provider on a host without a fast bf16 GEMM, `elasticmoe.utils.cpu_features`; or a bf16
checkpoint's own weights on an AMX host) goes to the grouped kernel, which is at least as fast as
widening it (`computes_fp32_with_bf16_weights`: on AMX tiles, fp32 activations in three bf16
parts, fp32's accuracy; elsewhere widened in registers), else (no kernel build) is widened at use;
bf16 values are exact in float32.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from elasticmoe.kernels.build import kernel_threads
from elasticmoe.kernels.grouped_gemm import computes_fp32_with_bf16_weights, kernel_linear

_mkldnn_linear = getattr(torch.ops.mkldnn, "_linear_pointwise", None)
_USE_ONEDNN_FP32 = _mkldnn_linear is not None and torch.backends.mkldnn.is_available()
SMALL_ROWS = 256


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [..., in] @ weight[out, in].T -> [..., out] (no bias), in x's dtype."""
    if x.dim() == 2 and x.shape[0] <= SMALL_ROWS and kernel_threads() > 1 and torch.get_num_threads() == 1:
        out = kernel_linear(x, weight)
        if out is not None:
            return out
    if weight.dtype == torch.bfloat16 and x.dtype == torch.float32 and computes_fp32_with_bf16_weights():
        out = kernel_linear(x.reshape(-1, x.shape[-1]), weight)
        if out is not None:
            return out.view(*x.shape[:-1], weight.shape[0])
    if weight.dtype != x.dtype:
        weight = weight.to(x.dtype)
    if _USE_ONEDNN_FP32 and x.dtype == torch.float32 and weight.dtype == torch.float32:
        return _mkldnn_linear(x, weight, None, "none", [], "")  # type: ignore[misc]
    return F.linear(x, weight)
