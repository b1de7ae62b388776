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
    for eviction in ("lru", "fifo"):
        engine = make_engine(tiny_model_dir, adapters, usage, adapter_eviction=eviction)
        assert resident(engine) == {"x", "y"}  # loaded into the free slots, in order
        serve(engine, "y-0", "y")  # y is the most recently used
        serve(engine, "z-0", "z")
        assert resident(engine) == {"y", "z"}, eviction
        assert engine.adapters.stats()["evictions"] == 1 and engine.adapters.stats()["preloads"] == 0
    # CoServe: z, registered with the slots full, is more probable than y: it is preloaded in y's
    # place at once (§4.1 while the server runs). y's request then displaces z, the less probable
    # resident, and once it finished z comes back.
    engine = make_engine(tiny_model_dir, adapters, usage, adapter_eviction="coserve")
    engine.adapters.lora.finish_swaps(block=True)
    assert resident(engine) == {"x", "z"} and engine.adapters.stats()["preloads"] == 1
    serve(engine, "y-0", "y")
    assert resident(engine) == {"x", "z"}
    assert {k: engine.adapters.stats()[k] for k in ("preloads", "evictions", "hits", "misses")} == {
        "preloads": 2, "evictions": 3, "hits": 0, "misses": 1}


def test_a_preloaded_adapter_serves_its_request_as_a_hit_with_its_own_weights(tiny_model_dir, adapters):
    def logprobs(engine: LLMEngine, adapter: str) -> list[float]:
        engine.add_request(f"{adapter}-0", [5, 6, 7], SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True,
                                                                     logprobs=0), adapter)
        out = []
        while engine.has_unfinished_requests():
            out += [lp.logprob for o in engine.step() for lp in o.new_logprobs or []]
        return out

    engine = make_engine(tiny_model_dir, adapters, {"x": 0.6, "y": 0.1, "z": 0.3})
    engine.adapters.lora.finish_swaps(block=True)  # z preloaded in y's slot (slot 1) at its load
    assert engine.adapters.lora.slot_of == {"x": 0, "z": 1}
    preloaded = logprobs(engine, "z")
    assert engine.adapters.stats()["hits"] == 1 and engine.adapters.stats()["misses"] == 0
    alone = make_engine(tiny_model_dir, {"z": adapters["z"]}, {})  # z in slot 0 from its load
    assert preloaded == pytest.approx(logprobs(alone, "z"), abs=1e-5)
    assert preloaded != pytest.approx(logprobs(alone, None), abs=1e-5)  # the adapter changes them


def test_registrations_on_an_idle_engine_preload_one_after_another(tiny_model_dir, adapters):
    # One slot. Each registration finds the previous preload's copy done (no step ran to collect
    # it) and replaces that adapter, unused since, with the likelier one just registered.
    engine = LLMEngine(EngineConfig(model=tiny_model_dir, dtype=torch.float32, num_kv_blocks=64, num_threads=1,
                                    max_loras=1, max_lora_rank=2, max_cpu_loras=3))
    lora = engine.adapters.lora
    for name, p in (("x", 0.1), ("y", 0.3), ("z", 0.6)):
        a = adapters[name]
        engine.adapters.load_lora(name, a.modules, a.weights, a.config.scaling, usage_probability=p)
        lora.wait_for_a_swap()
    lora.finish_swaps(block=True)
    assert lora.slot_of == {"z": 0} and engine.adapters.stats()["preloads"] == 2
    serve(engine, "z-0", "z")
    assert engine.adapters.stats()["hits"] == 1 and engine.adapters.stats()["misses"] == 0


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
