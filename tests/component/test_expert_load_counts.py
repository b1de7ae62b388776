"""`LLMEngine.expert_load`: every MoE block counts the tokens its router sends to each expert (the
expected load a scale balances and warms expert caches by), exactly: tokens run x top-k per layer."""

from __future__ import annotations

import torch

from elasticmoe.config import EngineConfig
from elasticmoe.engine.llm_engine import LLMEngine
from elasticmoe.sampling_params import SamplingParams

PROMPTS = ([5, 6, 7, 8, 9, 10], [11, 3, 200, 17], [42] * 9)
MAX_TOKENS = 8


def test_every_routed_token_is_counted_once_per_layer(tiny_model_dir):
    engine = LLMEngine(EngineConfig(model=tiny_model_dir, dtype=torch.float32, num_kv_blocks=16))
    assert engine.expert_load().sum() == 0
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(str(i), list(prompt), params)
    while engine.has_unfinished_requests():
        engine.step()
    load = engine.expert_load()
    cfg = engine.model_config
    assert load.shape == (len(engine.model.moe_blocks()), cfg.num_experts)
    # Every prompt token runs once, and every output token but the last is fed back once.
    tokens = sum(len(p) for p in PROMPTS) + len(PROMPTS) * (MAX_TOKENS - 1)
    assert (load.sum(axis=1) == tokens * cfg.top_k).all()
    assert (load > 0).sum() > cfg.top_k  # spread over experts, not one column
