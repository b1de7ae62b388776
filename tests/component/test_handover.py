"""Handing running sequences to a new engine at a step boundary (the switchover of a scale)."""

from __future__ import annotations

import pytest
import torch

from elasticmoe.adapters.lora import LoraAdapter
from elasticmoe.config import EngineConfig, ModelConfig
from elasticmoe.engine.kv_cache import KVCacheSpec
from elasticmoe.engine.llm_engine import LLMEngine
from elasticmoe.sampling_params import SamplingParams
from elasticmoe.structured_outputs import StructuredOutputs
from elasticmoe.tools.make_lora_adapter import make_lora_adapter

PROMPTS = [[5, 6, 7, 8] * 5, list(range(30, 70)), [9, 9, 9], [40, 41, 42]]
PARAMS = [
    SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True),
    SamplingParams(temperature=0.9, top_p=0.9, seed=11, max_tokens=20, ignore_eos=True),
    SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, logprobs=2),
    # the importing engine's matcher replays the output so far: the answer still matches the grammar
    SamplingParams(temperature=0.9, seed=4, max_tokens=20, structured_outputs=StructuredOutputs.text(
        "regex", "[a-z]{4,8}( [a-z]{4,8}){2,9}", "guided_regex")),
]


class SharedPool:
    """A KV provider that hands every engine the same pool, as the HMM does on a kept device."""

    pool: torch.Tensor | None = None

    def allocate(self, spec: KVCacheSpec, num_blocks: int) -> torch.Tensor:
        if self.pool is None:
            self.pool = torch.zeros(spec.pool_shape(num_blocks), dtype=spec.dtype)
        return self.pool


def make_engine(model_dir, kv=None, budget=2048) -> LLMEngine:
    config = EngineConfig(model=model_dir, dtype=torch.float32, num_kv_blocks=64, block_size=4,
                          max_num_batched_tokens=budget)
    return LLMEngine(config, kv_provider=kv)


def add_all(engine: LLMEngine) -> None:
    for i, (p, params) in enumerate(zip(PROMPTS, PARAMS, strict=True)):
        engine.add_request(str(i), p, params)


def drain(engine: LLMEngine, streams: dict[str, list]) -> None:
    while engine.has_unfinished_requests():
        for out in engine.step():
            streams.setdefault(out.request_id, []).append(out)


@pytest.mark.parametrize("kv_is_shared", [True, False], ids=["kv-kept", "kv-recomputed"])
def test_handover_continues_streams_exactly(tiny_model_dir, kv_is_shared):
    reference: dict[str, list] = {}
    engine = make_engine(tiny_model_dir)
    add_all(engine)
    drain(engine, reference)

    shared = SharedPool()
    old = make_engine(tiny_model_dir, kv=shared, budget=24)  # small budget: one prompt is mid-prefill
    add_all(old)
    streams: dict[str, list] = {}
    for _ in range(4):
        for out in old.step():
            streams.setdefault(out.request_id, []).append(out)
    snaps = old.export_requests(hand_over_kv=kv_is_shared)
    assert not old.has_unfinished_requests() and len(snaps) == len(PARAMS)
    assert any(s.was_running and s.num_computed_tokens > 0 for s in snaps)

    new = make_engine(tiny_model_dir, kv=shared if kv_is_shared else None)
    free_before = new.block_manager.num_free_blocks
    new.import_requests(snaps, kv_is_shared=kv_is_shared)
    kept_blocks = sum(len(s.block_ids) for s in snaps if s.was_running)
    assert free_before - new.block_manager.num_free_blocks == (kept_blocks if kv_is_shared else 0)
    computed_before = {r.request_id: r.num_computed_tokens for r in new.requests.values()}
    if kv_is_shared:
        assert any(n > 0 for n in computed_before.values())  # continued without recomputation
    drain(new, streams)

    for rid, ref in reference.items():
        got = streams[rid]
        assert got[-1].output_token_ids == ref[-1].output_token_ids, rid
        assert got[-1].finished and got[-1].finish_reason == ref[-1].finish_reason
        # The stream is unbroken: deltas concatenate to the final text, with no token repeated.
        assert "".join(o.new_text for o in got) == ref[-1].text
        assert sum(len(o.new_token_ids) for o in got) == len(ref[-1].output_token_ids)
        if PARAMS[int(rid)].logprobs:
            assert sum(len(o.new_logprobs or []) for o in got) == len(ref[-1].output_token_ids)
    assert new.block_manager.num_free_blocks == new.block_manager.num_blocks


def test_claim_refuses_blocks_in_use(tiny_model_dir):
    engine = make_engine(tiny_model_dir)
    engine.block_manager.claim([3, 5])
    with pytest.raises(ValueError):
        engine.block_manager.claim([5])
    with pytest.raises(ValueError):
        engine.block_manager.claim([7, 7])


@pytest.mark.parametrize("kv_is_shared", [True, False], ids=["kv-kept", "kv-recomputed"])
def test_a_handed_over_request_waits_for_its_lora_adapter_where_it_is_not_resident(
        tiny_model_dir, tmp_path, kv_is_shared):
    """A scale hands a running LoRA request to an engine whose one slot holds another adapter: the
    request waits for its adapter's swap-in instead of running on (and so on the base model)."""
    cfg = ModelConfig.from_pretrained(tiny_model_dir)
    adapters = {n: LoraAdapter.open(n, make_lora_adapter(tiny_model_dir, str(tmp_path / n), rank=2, seed=i + 1,
                                                         target_modules=("q_proj", "v_proj")), cfg)
                for i, n in enumerate(("tone", "style"))}

    def lora_engine(order: tuple[str, str], kv=None) -> LLMEngine:
        engine = LLMEngine(EngineConfig(model=tiny_model_dir, dtype=torch.float32, num_kv_blocks=64, block_size=4,
                                        num_threads=1, max_loras=1, max_lora_rank=2, max_cpu_loras=2),
                           kv_provider=kv)
        for name in order:  # the first one loaded takes the slot
            a = adapters[name]
            engine.adapters.load_lora(name, a.modules, a.weights, a.config.scaling)
        return engine

    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    reference: dict[str, list] = {}
    engine = lora_engine(("tone", "style"))
    engine.add_request("t", PROMPTS[0], params, "tone")
    drain(engine, reference)

    shared = SharedPool()
    old = lora_engine(("tone", "style"), kv=shared)
    old.add_request("t", PROMPTS[0], params, "tone")
    streams: dict[str, list] = {}
    for _ in range(3):
        for out in old.step():
            streams.setdefault(out.request_id, []).append(out)
    snaps = old.export_requests(hand_over_kv=kv_is_shared)
    assert snaps[0].was_running and snaps[0].num_computed_tokens > 0

    new = lora_engine(("style", "tone"), kv=shared if kv_is_shared else None)
    assert new.adapters.lora.index("tone") is None  # "style" holds the one slot
    new.import_requests(snaps, kv_is_shared=kv_is_shared)
    assert new.num_running == 0 and new.num_waiting == 1  # it waits for "tone"
    drain(new, streams)
    assert new.adapters.lora.index("tone") is not None
    assert streams["t"][-1].output_token_ids == reference["t"][-1].output_token_ids
    assert "".join(o.new_text for o in streams["t"]) == reference["t"][-1].text
    assert new.block_manager.num_free_blocks == new.block_manager.num_blocks
