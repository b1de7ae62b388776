"""The engine's LoRA hot set under CoServe's eviction (§4.3) and its baselines: usage probabilities
declared at load or read from a profile decide the victim; `lru` follows recency instead. Real
engine, tiny Qwen3-MoE, three adapters over two slots."""

from __future__ import annotations

import pytest
import torch

from elasticmoe.adapter_policy.profile import KindProfile, Profile
from elasticmoe.adapters.lora import LoraAdapter
from elasticmoe.config import EngineConfig, ModelConfig
from elasticmoe.engine.llm_engine import LLMEngine
from elasticmoe.sampling_params import SamplingParams
from elasticmoe.tools.make_lora_adapter import make_lora_adapter

PARAMS = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
NAMES = ("x", "y", "z")


@pytest.fixture(scope="module")
def adapters(tiny_model_dir, tmp_path_factory) -> dict[str, LoraAdapter]:
    root = tmp_path_factory.mktemp("lora-eviction")
    cfg = ModelConfig.from_pretrained(tiny_model_dir)
    return {n: LoraAdapter.open(n, make_lora_adapter(tiny_model_dir, str(root / n), rank=2,
                                                     target_modules=("q_proj", "v_proj"), seed=i + 1), cfg)
            for i, n in enumerate(NAMES)}


def make_engine(model_dir: str, adapters: dict[str, LoraAdapter], usage: dict[str, float | None],
                **options) -> LLMEngine:
    engine = LLMEngine(EngineConfig(model=model_dir, dtype=torch.float32, num_kv_blocks=64, num_threads=1,
                                    max_loras=2, max_lora_rank=2, max_cpu_loras=3, **options))
    for name, a in adapters.items():
        engine.adapters.load_lora(name, a.modules, a.weights, a.config.scaling, usage_probability=usage.get(name))
    return engine


def serve(engine: LLMEngine, request_id: str, adapter: str) -> None:
    engine.add_request(request_id, [5, 6, 7], PARAMS, adapter)
    while engine.has_unfinished_requests():
        engine.step()
    engine.adapters.swapper.lora.finish_swaps(block=True)


def resident(engine: LLMEngine) -> set[str]:
    return set(engine.adapters.lora.slot_of)


def test_declared_probabilities_decide_the_victim_where_lru_uses_recency(tiny_model_dir, adapters):
    usage = {"x": 0.6, "y": 0.1, "z": 0.3}
    for eviction, kept in (("coserve", {"x", "z"}), ("lru", {"y", "z"}), ("fifo", {"y", "z"})):
        engine = make_engine(tiny_model_dir, adapters, usage, adapter_eviction=eviction)
        assert resident(engine) == {"x", "y"}  # loaded into the free slots, in order
        serve(engine, "y-0", "y")  # y is the most recently used
        serve(engine, "z-0", "z")
        assert resident(engine) == kept, eviction
        assert engine.adapters.stats()["evictions"] == 1


def test_a_profile_outranks_the_declaration_and_declarations_are_checked(tiny_model_dir, adapters, tmp_path):
    profile = Profile("tiny", "cpu", {"base": KindProfile(4, 0.01, 0.01), "lora": KindProfile(4, 0.01, 0.01)},
                      kv_bytes_per_token=64, tokens_per_request=8, usage_probability={"x": 0.05},
                      adapter_kind={"x": "lora"})
    path = profile.save(tmp_path / "profile.json")
    engine = make_engine(tiny_model_dir, adapters, {"x": 0.6, "y": 0.1, "z": 0.3}, adapter_profile=str(path))
    serve(engine, "z-0", "z")
    assert resident(engine) == {"y", "z"}  # x is the rarest by the profile, whatever was declared
    assert {d["name"]: d.get("usage_probability") for d in engine.adapters.describe()} == {
        "x": 0.6, "y": 0.1, "z": 0.3}
    bad = make_engine(tiny_model_dir, {}, {})
    with pytest.raises(ValueError, match="usage_probability"):
        bad.adapters.load_lora("x", adapters["x"].modules, adapters["x"].weights, 1.0, usage_probability=2.0)
    assert not bad.adapters.lora.is_loaded("x")
    with pytest.raises(ValueError, match="adapter_eviction"):
        EngineConfig(model=tiny_model_dir, adapter_eviction="random")
