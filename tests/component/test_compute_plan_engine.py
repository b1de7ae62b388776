"""An engine on a host without a fast bf16 GEMM computes a bf16 model in float32: weights given by
a provider stay bf16 and are used in place (zero-copy), the default provider converts at load,
and both generate what a float32 engine over the same (bf16-rounded) weights generates."""

from __future__ import annotations

import pytest
import torch

from elasticmoe.config import EngineConfig
from elasticmoe.engine import llm_engine
from elasticmoe.engine.llm_engine import LLMEngine
from elasticmoe.models.weights import ParamSpec, SafetensorsWeightProvider
from elasticmoe.sampling_params import SamplingParams
from elasticmoe.utils.cpu_features import CpuFeatures

NO_BF16_GEMM = CpuFeatures(has_avx2=True, has_avx512=False, has_avx512_bf16=False, has_amx_bf16=False,
                           aten_capability="AVX2")


class RoundedProvider:
    """Checkpoint weights rounded to bf16, handed out in `as_dtype` (None: the dtype asked for),
    kept so tests can check they are used in place."""

    def __init__(self, model_dir: str, as_dtype: torch.dtype | None = None) -> None:
        self.disk = SafetensorsWeightProvider(model_dir)
        self.as_dtype = as_dtype
        self.given: dict[str, torch.Tensor] = {}

    def get(self, spec: ParamSpec, dtype: torch.dtype) -> torch.Tensor:
        t = self.disk.get(spec, torch.bfloat16).to(self.as_dtype or dtype)
        self.given[spec.name] = t
        return t


def _generate(engine: LLMEngine) -> dict[str, list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    for i, prompt in enumerate([[5, 17, 99, 230, 11], list(range(100, 130))]):
        engine.add_request(str(i), prompt, params)
    outputs = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                outputs[out.request_id] = out.output_token_ids
    return outputs


@pytest.mark.parametrize("arch", ["qwen3_moe", "deepseek_v2"])
def test_bf16_without_bf16_gemm_runs_in_float32(arch, tiny_model_dirs, monkeypatch):
    model_dir = tiny_model_dirs[arch]
    reference = _generate(LLMEngine(EngineConfig(model=model_dir, dtype=torch.float32),
                                    weight_provider=RoundedProvider(model_dir, torch.float32)))

    monkeypatch.setattr(llm_engine, "detect_cpu_features", lambda: NO_BF16_GEMM)
    provider = RoundedProvider(model_dir)
    shared = LLMEngine(EngineConfig(model=model_dir, dtype=torch.bfloat16), weight_provider=provider)
    assert (shared.compute_plan.weight_dtype, shared.compute_plan.compute_dtype) == (torch.bfloat16, torch.float32)
    assert shared.config.dtype == torch.float32 and shared.kv_pool.dtype == torch.float32
    for name, tensor in provider.given.items():  # zero-copy: the provider's bf16 tensors, in place
        assert shared.weights[name].data_ptr() == tensor.data_ptr() and tensor.dtype == torch.bfloat16
    assert _generate(shared) == reference

    converted = LLMEngine(EngineConfig(model=model_dir, dtype=torch.bfloat16))  # default provider
    assert converted.weights["embed"].dtype == torch.float32
    assert converted.compute_plan.compute_dtype == torch.float32


def test_bf16_checkpoint_in_float32_keeps_its_experts_in_bf16(tiny_model_dirs, tmp_path):
    """Lossless: the experts of a bf16 checkpoint stay bf16 (half the bytes a decode step reads),
    every other weight too where the kernel computes fp32 x bf16 (the projections and the LM
    head), and the engine generates what an engine over fp32 copies of the same weights generates."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from elasticmoe.kernels.grouped_gemm import computes_fp32_with_bf16_weights

    src = tiny_model_dirs["qwen3_moe"]
    bf16_dir = str(tmp_path / "bf16")
    AutoModelForCausalLM.from_pretrained(src, dtype=torch.bfloat16).save_pretrained(bf16_dir)
    AutoTokenizer.from_pretrained(src).save_pretrained(bf16_dir)
    engine = LLMEngine(EngineConfig(model=bf16_dir, dtype=torch.float32))
    block = engine.model.moe_blocks()[0]
    assert block.w13.dtype == torch.bfloat16
    dense = torch.bfloat16 if computes_fp32_with_bf16_weights() else torch.float32
    assert engine.weights["embed"].dtype == dense and engine.weights["layers.0.attn.qkv"].dtype == dense
    info = engine.compute_info()  # what the startup log and /admin/status report
    assert (info["compute_dtype"], info["expert_weight_dtype"]) == ("float32", "bfloat16")
    assert info["dense_weight_dtype"] == str(dense).removeprefix("torch.")
    reference = LLMEngine(EngineConfig(model=bf16_dir, dtype=torch.float32),
                          weight_provider=RoundedProvider(bf16_dir, torch.float32))
    assert reference.model.moe_blocks()[0].w13.dtype == torch.float32
    assert _generate(engine) == _generate(reference)


def test_lora_over_bf16_dense_weights_computed_in_float32_equals_float32_weights(tiny_bf16_model_dirs, tmp_path):
    """A bf16 checkpoint computed in fp32 keeps its projections in bf16 (where the kernel computes fp32
    x bf16): LoRA deltas on those projections and on the experts give what they give over fp32 copies
    of the same weights (greedy tokens, logprobs to 1e-4), base-model requests in the same batch too."""
    from elasticmoe.adapters.lora import LoraAdapter
    from elasticmoe.config import ModelConfig
    from elasticmoe.kernels.grouped_gemm import computes_fp32_with_bf16_weights
    from elasticmoe.tools.make_lora_adapter import make_lora_adapter

    model_dir = tiny_bf16_model_dirs["qwen3_moe"]
    path = make_lora_adapter(model_dir, str(tmp_path / "lora"), rank=4, seed=5,
                             target_modules=("q_proj", "v_proj", "o_proj", "gate_proj", "down_proj"))
    adapter = LoraAdapter.open("a", path, ModelConfig.from_pretrained(model_dir))
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=3)

    def run(engine: LLMEngine) -> dict[str, tuple[list[int], list[float]]]:
        engine.adapters.load_lora("a", adapter.modules, adapter.weights, adapter.config.scaling)
        for rid, name in [("lora", "a"), ("base", None)]:  # one prompt: the adapter's effect shows
            engine.add_request(rid, [5, 17, 99, 230, 11, *range(100, 110)], params, name)
        logprobs: dict[str, list[float]] = {}
        out = {}
        while engine.has_unfinished_requests():
            for o in engine.step():
                logprobs.setdefault(o.request_id, []).extend(lp.logprob for lp in o.new_logprobs or [])
                if o.finished:
                    out[o.request_id] = (o.output_token_ids, logprobs[o.request_id])
        return out

    config = EngineConfig(model=model_dir, dtype=torch.float32, max_loras=1, max_lora_rank=4)
    engine = LLMEngine(config)
    dense = torch.bfloat16 if computes_fp32_with_bf16_weights() else torch.float32
    assert engine.weights["layers.0.attn.qkv"].dtype == dense
    got = run(engine)
    want = run(LLMEngine(config, weight_provider=RoundedProvider(model_dir, torch.float32)))
    for rid in ("lora", "base"):
        assert got[rid][0] == want[rid][0], rid
        assert got[rid][1] == pytest.approx(want[rid][1], abs=1e-4), rid
    # the adapter is on (else the comparison could not fail): other tokens, or other logprobs
    assert got["lora"][0] != got["base"][0] or got["lora"][1] != pytest.approx(got["base"][1], abs=1e-3)
