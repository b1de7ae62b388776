"""What this CPU computes fast, and the compute path the engine picks from it.

`cpu_compute_info(requested_dtype, checkpoint_dtype)` is the one call for callers that
only want to show it (e.g. `/admin/status`): a plain dict of what was detected and chosen.

Why it matters: PyTorch runs bfloat16 matmuls through oneDNN only where oneDNN has a
bf16 kernel (AVX-512 cores, natively with avx512_bf16 or AMX); elsewhere it falls back
to a reference loop (measured 0.3 GFLOP/s on an AVX2+FMA host, against 105 GFLOP/s in
float32). So a bf16 checkpoint on such a host is computed in float32 (bf16 values are
exact in float32): the default weight provider converts at load; weights given by a
provider (shared memory) stay bf16 and are widened at use.

The caps that PyTorch and oneDNN honour are read too, so `ATEN_CPU_CAPABILITY=avx2
ONEDNN_MAX_CPU_ISA=AVX2` on an AVX-512 host emulates an AVX2-only host faithfully.
"""

from __future__ import annotations

import ctypes
import logging
import os
import platform
from dataclasses import asdict, dataclass
from functools import cache
from typing import Any

import torch

logger = logging.getLogger(__name__)

# oneDNN ISA caps (ONEDNN_MAX_CPU_ISA) below which it has no bf16 matmul kernel.
_ONEDNN_CAPS_WITHOUT_BF16 = {"SSE41", "AVX", "AVX2", "AVX2_VNNI", "DEFAULT"}
_ONEDNN_CAPS_WITHOUT_NATIVE_BF16 = _ONEDNN_CAPS_WITHOUT_BF16 | {"AVX512_CORE", "AVX512_CORE_VNNI"}
_SYS_ARCH_PRCTL, _ARCH_REQ_XCOMP_PERM, _XFEATURE_XTILEDATA = 158, 0x1023, 18  # x86_64 Linux


@dataclass(frozen=True, slots=True)
class CpuFeatures:
    """ISA facts of this host, with the caps PyTorch (ATEN_CPU_CAPABILITY) and oneDNN
    (ONEDNN_MAX_CPU_ISA) apply to themselves."""

    has_avx2: bool  # with FMA
    has_avx512: bool  # avx512 f/bw/vl/dq: what oneDNN calls avx512_core
    has_avx512_bf16: bool
    has_amx_bf16: bool  # in the CPU and granted by the OS (Linux hands AMX's tile state out on request)
    aten_capability: str  # the vector ISA of PyTorch's own kernels: "AVX512", "AVX2", "DEFAULT", ...
    onednn_max_isa: str | None = None  # ONEDNN_MAX_CPU_ISA when set

    @property
    def bf16_gemm(self) -> str:
        """How bf16 matmuls run: "amx", "avx512_bf16" (native dot products), "avx512" (oneDNN
        converts to fp32 on the fly, still far from the reference loop) or "reference"."""
        cap = (self.onednn_max_isa or "ALL").upper()
        if not self.has_avx512 or cap in _ONEDNN_CAPS_WITHOUT_BF16:
            return "reference"
        if cap in _ONEDNN_CAPS_WITHOUT_NATIVE_BF16:
            return "avx512"
        if self.has_amx_bf16 and not cap.startswith("AVX512_CORE_BF16"):
            return "amx"
        return "avx512_bf16" if self.has_avx512_bf16 else "avx512"

    @property
    def has_fast_bf16_gemm(self) -> bool:
        return self.bf16_gemm != "reference"

    @property
    def kernel_isa(self) -> str:
        """Which build of our own kernels (`elasticmoe.kernels`) runs here: "amx" (the avx512_bf16
        build plus AMX tiles for bf16 weights), "avx512_bf16", "avx512", "avx2" or "none" (plain
        PyTorch). Capped like PyTorch's own kernels, and AMX also by oneDNN's cap."""
        aten = self.aten_capability.upper()
        if self.has_avx512 and aten.startswith("AVX512"):
            if self.has_amx_bf16 and self.has_avx512_bf16 and self.bf16_gemm == "amx":
                return "amx"
            return "avx512_bf16" if self.has_avx512_bf16 else "avx512"
        if self.has_avx2 and (aten == "AVX2" or aten.startswith("AVX512")):
            return "avx2"
        return "none"


def _cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def _amx_permitted() -> bool:
    """Ask Linux for AMX's tile state (arch_prctl ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA): once
    per process, harmless when already granted; refused by kernels before 5.16."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.syscall(_SYS_ARCH_PRCTL, _ARCH_REQ_XCOMP_PERM, _XFEATURE_XTILEDATA) == 0
    except (OSError, AttributeError):
        return False


@cache
def detect_cpu_features() -> CpuFeatures:
    """This host's features (read once per process)."""
    flags = _cpu_flags()
    return CpuFeatures(
        has_avx2={"avx2", "fma"} <= flags,
        has_avx512={"avx512f", "avx512bw", "avx512vl", "avx512dq"} <= flags,
        has_avx512_bf16="avx512_bf16" in flags,
        has_amx_bf16="amx_bf16" in flags and platform.machine() == "x86_64" and _amx_permitted(),
        aten_capability=torch.backends.cpu.get_cpu_capability(),
        onednn_max_isa=os.environ.get("ONEDNN_MAX_CPU_ISA") or None,
    )


@dataclass(frozen=True, slots=True)
class ComputePlan:
    """The dtypes an engine runs in. `weight_dtype` is what weights are stored in (asked of the
    weight provider); `compute_dtype` is that of activations, the KV cache and adapter slots.
    They differ only when bf16 storage is computed in float32 (see the module docstring)."""

    requested: str  # "auto", "bfloat16", "float32", "float16"
    weight_dtype: torch.dtype
    compute_dtype: torch.dtype
    expert_kernel: str  # the grouped expert kernel's ISA build, or "torch" (PyTorch ops only)
    reason: str

    @property
    def prefill_attention(self) -> str:
        """What a model's causal prefill attention runs on (`layers.attention.kernel_causal`): the
        causal kernel, in bf16 pairs where the build has `vdpbf16ps` (head widths that are
        multiples of 32), or PyTorch's SDPA (head widths off the vector width run SDPA anyway)."""
        if self.expert_kernel == "torch":
            return "sdpa" if self.compute_dtype == torch.float32 else "batched matmuls (<= 128 tokens), else sdpa"
        if self.compute_dtype == torch.float32:
            return "causal kernel (fp32)"
        if self.expert_kernel == "amx":
            return "sdpa (oneDNN on AMX tiles)"
        if self.expert_kernel == "avx512_bf16":
            return "causal kernel (bf16 pairs)"
        return "causal kernel (fp32 arithmetic)"


def dtype_name(dtype: torch.dtype | None) -> str:
    """`torch.bfloat16` -> "bfloat16" (None: "auto"), as logs and status pages name dtypes."""
    return "auto" if dtype is None else str(dtype).removeprefix("torch.")


def choose_compute_plan(
    features: CpuFeatures,
    requested: torch.dtype | None,
    checkpoint_dtype: torch.dtype | None,
    weights_from_provider: bool = False,
) -> ComputePlan:
    """Pick the dtypes for `requested` (None: "auto") on a host with `features`.

    auto: the checkpoint's dtype when this CPU computes it fast (bf16 with a bf16 GEMM, or
    float32), else float32 (every bf16/fp16 value is exact in float32). An explicit 16-bit
    dtype the CPU has no fast GEMM for is still stored as asked when the weights come from a
    provider (their memory is shared and typed), and computed in float32; the default provider
    converts at load (2x the weight memory of bf16, at fp32 speed instead of a reference loop).
    """
    kernel = features.kernel_isa if features.kernel_isa != "none" else "torch"
    target = requested if requested is not None else (checkpoint_dtype or torch.float32)
    if target == torch.float32:
        return ComputePlan(dtype_name(requested), torch.float32, torch.float32, kernel, "float32")
    if target == torch.bfloat16 and features.has_fast_bf16_gemm:
        why = f"bf16 GEMM: {features.bf16_gemm}"
        return ComputePlan(dtype_name(requested), torch.bfloat16, torch.bfloat16, kernel, why)
    # A 16-bit dtype without a fast GEMM here (fp16 never has one in PyTorch's CPU build).
    if requested is None:
        why = f"checkpoint {dtype_name(target)}: no fast {dtype_name(target)} GEMM here (bf16 GEMM: {features.bf16_gemm})"
        return ComputePlan("auto", torch.float32, torch.float32, kernel, why)
    storage = target if weights_from_provider else torch.float32
    why = f"no fast {dtype_name(target)} GEMM here (bf16 GEMM: {features.bf16_gemm}): computed in float32"
    return ComputePlan(dtype_name(requested), storage, torch.float32, kernel, why)


def checkpoint_dtype(hf_config: dict[str, Any]) -> torch.dtype | None:
    """The dtype a Hugging Face config.json says its weights are stored in (None: not said)."""
    name = hf_config.get("torch_dtype") or hf_config.get("dtype")
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}.get(str(name))


def cpu_compute_info(
    requested: torch.dtype | None = None, checkpoint: torch.dtype | None = None, plan: ComputePlan | None = None
) -> dict[str, Any]:
    """What was detected and chosen, as a plain dict (for logs and status pages). Pass the
    engine's `plan` to report it, else the plan for `requested` on `checkpoint` is derived."""
    features = detect_cpu_features()
    plan = plan or choose_compute_plan(features, requested, checkpoint)
    return {
        **asdict(features),
        "bf16_gemm": features.bf16_gemm,
        "kernel_isa": features.kernel_isa,
        "num_threads": torch.get_num_threads(),
        "requested_dtype": plan.requested,
        "weight_dtype": dtype_name(plan.weight_dtype),
        "compute_dtype": dtype_name(plan.compute_dtype),
        "expert_kernel": plan.expert_kernel,
        "prefill_attention": plan.prefill_attention,
        "reason": plan.reason,
    }
