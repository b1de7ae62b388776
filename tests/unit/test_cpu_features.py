"""ISA detection and the compute path chosen from it, over hand-made feature sets."""

from __future__ import annotations

import pytest
import torch

from elasticmoe.config import parse_engine_dtype
from elasticmoe.utils.cpu_features import (
    CpuFeatures,
    checkpoint_dtype,
    choose_compute_plan,
    cpu_compute_info,
    detect_cpu_features,
)

AVX2_ONLY = CpuFeatures(has_avx2=True, has_avx512=False, has_avx512_bf16=False, has_amx_bf16=False,
                        aten_capability="AVX2")
AVX512 = CpuFeatures(has_avx2=True, has_avx512=True, has_avx512_bf16=False, has_amx_bf16=False,
                     aten_capability="AVX512")
AVX512_BF16 = CpuFeatures(has_avx2=True, has_avx512=True, has_avx512_bf16=True, has_amx_bf16=False,
                          aten_capability="AVX512")
AMX = CpuFeatures(has_avx2=True, has_avx512=True, has_avx512_bf16=True, has_amx_bf16=True,
                  aten_capability="AVX512")
# An AVX-512 host run with ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 (how we emulate AVX2-only).
EMULATED_AVX2 = CpuFeatures(has_avx2=True, has_avx512=True, has_avx512_bf16=True, has_amx_bf16=False,
                            aten_capability="AVX2", onednn_max_isa="AVX2")
BARE = CpuFeatures(has_avx2=False, has_avx512=False, has_avx512_bf16=False, has_amx_bf16=False,
                   aten_capability="DEFAULT")


@pytest.mark.parametrize(("features", "bf16_gemm", "kernel_isa"), [
    (AVX2_ONLY, "reference", "avx2"),
    (AVX512, "avx512", "avx512"),
    (AVX512_BF16, "avx512_bf16", "avx512_bf16"),
    (AMX, "amx", "amx"),
    # oneDNN capped below AMX (how we compare with and without AMX on one host): no AMX for ours either
    (CpuFeatures(has_avx2=True, has_avx512=True, has_avx512_bf16=True, has_amx_bf16=True, aten_capability="AVX512",
                 onednn_max_isa="AVX512_CORE_BF16"), "avx512_bf16", "avx512_bf16"),
    (EMULATED_AVX2, "reference", "avx2"),
    (BARE, "reference", "none"),
])
def test_what_runs_fast_follows_the_isa_and_its_caps(features, bf16_gemm, kernel_isa):
    assert features.bf16_gemm == bf16_gemm
    assert features.has_fast_bf16_gemm == (bf16_gemm != "reference")
    assert features.kernel_isa == kernel_isa


def test_bf16_checkpoint_without_bf16_gemm_is_computed_in_float32():
    # auto: fp32 throughout (converted at load).
    plan = choose_compute_plan(AVX2_ONLY, None, torch.bfloat16)
    assert (plan.weight_dtype, plan.compute_dtype) == (torch.float32, torch.float32)
    # bf16 asked: the default provider converts at load ...
    plan = choose_compute_plan(EMULATED_AVX2, torch.bfloat16, torch.bfloat16)
    assert (plan.weight_dtype, plan.compute_dtype) == (torch.float32, torch.float32)
    # ... a provider's (shared, typed) memory stays bf16 and is widened at use.
    plan = choose_compute_plan(AVX2_ONLY, torch.bfloat16, torch.bfloat16, weights_from_provider=True)
    assert (plan.weight_dtype, plan.compute_dtype) == (torch.bfloat16, torch.float32)
    assert plan.requested == "bfloat16" and "float32" in plan.reason


@pytest.mark.parametrize("features", [AVX512, AVX512_BF16, AMX])
def test_bf16_stays_bf16_where_the_gemm_is_fast(features):
    for requested in (None, torch.bfloat16):
        plan = choose_compute_plan(features, requested, torch.bfloat16)
        assert (plan.weight_dtype, plan.compute_dtype) == (torch.bfloat16, torch.bfloat16)


@pytest.mark.parametrize("features", [AVX2_ONLY, AVX512_BF16])
def test_auto_never_loses_precision(features):
    assert choose_compute_plan(features, None, torch.float32).compute_dtype == torch.float32
    assert choose_compute_plan(features, None, torch.float16).compute_dtype == torch.float32  # exact in fp32
    assert choose_compute_plan(features, None, None).compute_dtype == torch.float32
    assert choose_compute_plan(features, torch.float32, torch.bfloat16).compute_dtype == torch.float32


def test_prefill_attention_is_named_in_the_plan():
    assert choose_compute_plan(AVX512_BF16, None, torch.bfloat16).prefill_attention == "causal kernel (bf16 pairs)"
    assert choose_compute_plan(AVX512_BF16, torch.float32, torch.bfloat16).prefill_attention == "causal kernel (fp32)"
    assert choose_compute_plan(AMX, None, torch.bfloat16).prefill_attention == "sdpa (oneDNN on AMX tiles)"
    assert choose_compute_plan(AMX, torch.float32, torch.bfloat16).prefill_attention == "causal kernel (fp32)"
    assert choose_compute_plan(AVX512, torch.bfloat16, torch.bfloat16).prefill_attention.startswith("causal kernel")
    assert choose_compute_plan(BARE, None, torch.float32).prefill_attention == "sdpa"


def test_expert_kernel_is_named_in_the_plan():
    assert choose_compute_plan(AVX512_BF16, None, torch.bfloat16).expert_kernel == "avx512_bf16"
    assert choose_compute_plan(EMULATED_AVX2, None, torch.bfloat16).expert_kernel == "avx2"
    assert choose_compute_plan(BARE, None, torch.bfloat16).expert_kernel == "torch"


def test_checkpoint_dtype_and_auto_parsing():
    assert checkpoint_dtype({"torch_dtype": "bfloat16"}) == torch.bfloat16
    assert checkpoint_dtype({"dtype": "float32"}) == torch.float32
    assert checkpoint_dtype({}) is None
    assert parse_engine_dtype("auto") is None
    assert parse_engine_dtype("float32") == torch.float32


def test_this_hosts_info_is_a_plain_dict():
    info = cpu_compute_info(None, torch.bfloat16)
    assert info["requested_dtype"] == "auto"
    assert info["compute_dtype"] in ("bfloat16", "float32")
    assert info["bf16_gemm"] == detect_cpu_features().bf16_gemm
    assert all(isinstance(v, (str, bool, int, type(None))) for v in info.values())


def test_thread_governor_drops_to_one_thread_under_pressure_and_comes_back(monkeypatch):
    from elasticmoe.utils.cpu_pressure import ThreadGovernor

    readings = iter([0.0, 10.0, 80.0, 40.0, 5.0])
    governor = ThreadGovernor(2, high=50, low=20, period_s=0, read=lambda: next(readings))  # first: enabled?
    assert governor.enabled
    assert [governor.threads() for _ in range(4)] == [2, 1, 1, 2]  # 10, 80 (down), 40 (hold), 5 (up)
    monkeypatch.setenv("ELASTICMOE_ADAPTIVE_THREADS", "0")
    assert ThreadGovernor(2, read=lambda: 99.0).threads() == 2
    assert ThreadGovernor(2, read=lambda: None).threads() == 2  # no PSI here
    assert ThreadGovernor(1, read=lambda: 99.0).threads() == 1
