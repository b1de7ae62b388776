"""Oracle: our logits and greedy generations equal transformers' own forward."""

from __future__ import annotations

import pytest
import torch

from elasticmoe.config import EngineConfig
from elasticmoe.engine.llm_engine import LLMEngine
from elasticmoe.sampling_params import SamplingParams

ARCHS = ("qwen3_moe", "mixtral", "deepseek_v2")


def _hf_model(model_dir: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def _record_logits(engine: LLMEngine) -> list[torch.Tensor]:
    recorded: list[torch.Tensor] = []
    original = engine.model.compute_logits

    def compute_logits(hidden):
        logits = original(hidden)
        recorded.append(logits.clone())
        return logits

    engine.model.compute_logits = compute_logits  # type: ignore[method-assign]
    return recorded


def _run(engine: LLMEngine, prompts: list[list[int]], max_tokens: int) -> dict[str, list[int]]:
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))
    outputs = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                outputs[out.request_id] = out.output_token_ids
    return outputs


@pytest.mark.parametrize("stored", ["fp32", "bf16"], ids=["fp32-checkpoint", "bf16-checkpoint"])
@pytest.mark.parametrize("chunk", [None, 8], ids=["whole-prefill", "chunked-prefill"])
@pytest.mark.parametrize("arch", ARCHS)
def test_prefill_and_paged_decode_logits_match(arch, chunk, stored, tiny_model_dirs, tiny_bf16_model_dirs):
    """Computed in fp32. A bf16 checkpoint keeps its experts in bf16 (exact) and, on AMX hosts,
    computes them on AMX tiles with fp32 activations split into three bf16 parts: still fp32's
    accuracy, against transformers' fp32 forward over the same bf16 values."""
    model_dir = (tiny_model_dirs if stored == "fp32" else tiny_bf16_model_dirs)[arch]
    hf = _hf_model(model_dir)
    # Small blocks so the 16+ decode steps cross several block boundaries; a small
    # token budget splits the 19-token prompt into chunks of 8, 8 and 3.
    config = EngineConfig(model=model_dir, dtype=torch.float32, block_size=4, num_kv_blocks=64,
                          max_num_batched_tokens=chunk or 2048)
    engine = LLMEngine(config)
    recorded = _record_logits(engine)
    prompt = list(range(3, 40, 2))  # 19 tokens
    out = _run(engine, [prompt], max_tokens=20)["0"]

    full = torch.tensor([prompt + out])
    with torch.no_grad():
        ref = hf(full).logits[0].float()  # [L, V]
    # recorded[s] is the logits of the token sampled at step s: position len(prompt)-1+s.
    assert len(recorded) == 20
    for step, logits in enumerate(recorded):
        diff = (logits[0] - ref[len(prompt) - 1 + step]).abs().max().item()
        assert diff <= 1e-4, f"{arch}: step {step} max abs diff {diff}"


@pytest.mark.parametrize("stored", ["fp32", "bf16"], ids=["fp32-checkpoint", "bf16-checkpoint"])
@pytest.mark.parametrize("arch", ARCHS)
def test_long_prefill_logits_match(arch, stored, tiny_model_dirs, tiny_bf16_model_dirs):
    """A 300-token prompt gives each expert ~75-150 rows: the grouped GEMM's prefill path (packed
    panels on AVX2), which the short prompts above never reach."""
    model_dir = (tiny_model_dirs if stored == "fp32" else tiny_bf16_model_dirs)[arch]
    hf = _hf_model(model_dir)
    engine = LLMEngine(EngineConfig(model=model_dir, dtype=torch.float32, num_kv_blocks=64))
    recorded = _record_logits(engine)
    prompt = torch.randint(3, engine.model_config.vocab_size, (300,), generator=torch.Generator().manual_seed(0))
    out = _run(engine, [prompt.tolist()], max_tokens=3)["0"]
    with torch.no_grad():
        ref = hf(torch.tensor([prompt.tolist() + out])).logits[0].float()
    for step, logits in enumerate(recorded):
        diff = (logits[0] - ref[len(prompt) - 1 + step]).abs().max().item()
        assert diff <= 1e-4, f"{arch}: step {step} max abs diff {diff}"


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_generation_matches_transformers_generate(arch, tiny_model_dirs):
    model_dir = tiny_model_dirs[arch]
    hf = _hf_model(model_dir)
    engine = LLMEngine(EngineConfig(model=model_dir, dtype=torch.float32))
    prompts = [[5, 17, 99, 230, 11], list(range(100, 140))]
    ours = _run(engine, prompts, max_tokens=32)
    for i, p in enumerate(prompts):
        with torch.no_grad():
            ref = hf.generate(torch.tensor([p]), max_new_tokens=32, min_new_tokens=32, do_sample=False)
        assert ours[str(i)] == ref[0, len(p) :].tolist(), f"{arch}: prompt {i}"


@pytest.mark.parametrize("arch", ARCHS)
def test_logits_after_a_cached_prefix_match(arch, tiny_model_dirs):
    """A request that starts past the blocks an earlier request of the same prefix left in the
    KV cache (automatic prefix caching) computes the logits of its full prompt."""
    model_dir = tiny_model_dirs[arch]
    hf = _hf_model(model_dir)
    engine = LLMEngine(EngineConfig(model=model_dir, dtype=torch.float32, block_size=4, num_kv_blocks=64))
    prefix = list(range(3, 40, 2))  # 19 tokens: 4 full blocks
    _run(engine, [prefix + [50]], max_tokens=2)
    recorded = _record_logits(engine)
    prompt = prefix + [60, 61, 62]
    engine.add_request("cached", prompt, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    out = []
    while engine.has_unfinished_requests():
        for o in engine.step():
            out = o.output_token_ids
    assert engine.block_manager.prefix_hits == 16
    with torch.no_grad():
        ref = hf(torch.tensor([prompt + out])).logits[0].float()
    assert len(recorded) == 8
    for step, logits in enumerate(recorded):
        diff = (logits[0] - ref[len(prompt) - 1 + step]).abs().max().item()
        assert diff <= 1e-4, f"{arch}: step {step} max abs diff {diff}"


@pytest.mark.parametrize("stored", ["fp32", "bf16"], ids=["fp32-checkpoint", "bf16-checkpoint"])
@pytest.mark.parametrize("chunk", [None, 8], ids=["whole-prefill", "chunked-prefill"])
def test_mla_prefill_on_the_causal_kernel_matches(chunk, stored, tmp_path, monkeypatch):
    """DeepSeek-V2 with head widths the causal kernel serves (keys 16 + 16, values 32; the tiny
    preset's 24 and 16 fall back to SDPA on AVX-512): its prefill runs on the kernel, keys and
    values expanded from the latents, and the logits equal transformers'."""
    from elasticmoe.kernels import causal_attention as kernel
    from elasticmoe.tools import make_model as mm

    if not kernel.available():
        pytest.skip("no kernel build on this host")
    preset = {**mm.PRESETS["deepseek_v2"]["tiny"], "qk_rope_head_dim": 16, "qk_nope_head_dim": 16, "v_head_dim": 32}
    monkeypatch.setitem(mm.PRESETS["deepseek_v2"], "tiny-mla32", preset)
    monkeypatch.setitem(mm._INIT_STD, "tiny-mla32", mm._INIT_STD["tiny"])
    monkeypatch.setitem(mm._SAVE_DTYPE, "tiny-mla32", "float32" if stored == "fp32" else "bfloat16")
    model_dir = str(mm.make_model("deepseek_v2", "tiny-mla32", seed=0, out=str(tmp_path / "mla")))
    calls = []
    real = kernel.causal_attention_kv
    monkeypatch.setattr("elasticmoe.layers.attention.causal_attention_kv",
                        lambda q, k, v, scale: calls.append(k.shape[-1]) or real(q, k, v, scale))
    hf = _hf_model(model_dir)
    engine = LLMEngine(EngineConfig(model=model_dir, dtype=torch.float32, block_size=4, num_kv_blocks=64,
                                    max_num_batched_tokens=chunk or 2048))
    recorded = _record_logits(engine)
    prompt = list(range(3, 40, 2))  # 19 tokens
    out = _run(engine, [prompt], max_tokens=6)["0"]
    assert calls and set(calls) == {32}  # every layer's prefill (and chunk) on the kernel
    with torch.no_grad():
        ref = hf(torch.tensor([prompt + out])).logits[0].float()
    for step, logits in enumerate(recorded):
        diff = (logits[0] - ref[len(prompt) - 1 + step]).abs().max().item()
        assert diff <= 1e-4, f"step {step} max abs diff {diff}"
