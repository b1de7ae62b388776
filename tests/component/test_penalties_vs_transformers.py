"""Oracle: greedy generation with OpenAI's presence and frequency penalties and a logit bias equals
transformers' `generate` with the same rule as a logits processor (counts over the generated tokens
only, as OpenAI and vLLM define them), for the three families; in the same batch a request without
them is unchanged. The repetition penalty equals transformers' own `repetition_penalty`."""

from __future__ import annotations

import pytest
import torch

from elasticmoe.config import EngineConfig
from elasticmoe.engine.llm_engine import LLMEngine
from elasticmoe.sampling_params import SamplingParams

ARCHS = ("qwen3_moe", "mixtral", "deepseek_v2")
MAX_TOKENS = 24
PROMPTS = [[5, 17, 99, 230, 11], list(range(100, 130))]
ADJUSTED = [dict(presence_penalty=0.8, frequency_penalty=0.6, logit_bias={7: 3.0, 11: -100.0}),
            dict(frequency_penalty=-0.5, logit_bias={300: 1.5})]


class _OpenAIAdjustments:
    """transformers logits processor: `logit - frequency * count - presence * (count > 0) + bias`."""

    def __init__(self, prompt_len: int, presence_penalty: float = 0.0, frequency_penalty: float = 0.0,
                 logit_bias: dict[int, float] | None = None) -> None:
        self.prompt_len = prompt_len
        self.presence, self.frequency = presence_penalty, frequency_penalty
        self.bias = logit_bias or {}

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        vocab = scores.shape[-1]
        counts = torch.bincount(input_ids[0, self.prompt_len :], minlength=vocab)[:vocab].to(scores.dtype)
        scores = scores - self.frequency * counts - self.presence * (counts > 0).to(scores.dtype)
        for token, bias in self.bias.items():
            scores[:, token] += bias
        return scores


def _reference(hf, prompt: list[int], **adjustments) -> list[int]:
    from transformers import LogitsProcessorList

    processors = LogitsProcessorList([_OpenAIAdjustments(len(prompt), **adjustments)]) if adjustments else None
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=MAX_TOKENS, min_new_tokens=MAX_TOKENS,
                          do_sample=False, logits_processor=processors)
    return out[0, len(prompt) :].tolist()


@pytest.mark.parametrize("arch", ARCHS)
def test_repetition_penalty_matches_transformers_own(arch, tiny_model_dirs):
    """transformers' `repetition_penalty` is the same rule over the prompt and the output."""
    from transformers import AutoModelForCausalLM

    model_dir = tiny_model_dirs[arch]
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    engine = LLMEngine(EngineConfig(model=model_dir, dtype=torch.float32))
    for i, (prompt, penalty) in enumerate(zip(PROMPTS, (1.3, 0.8), strict=True)):
        engine.add_request(str(i), prompt, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True,
                                                          repetition_penalty=penalty))
    ours: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                ours[out.request_id] = out.output_token_ids
    for i, (prompt, penalty) in enumerate(zip(PROMPTS, (1.3, 0.8), strict=True)):
        with torch.no_grad():
            ref = hf.generate(torch.tensor([prompt]), max_new_tokens=MAX_TOKENS, min_new_tokens=MAX_TOKENS,
                              do_sample=False, repetition_penalty=penalty)
        assert ours[str(i)] == ref[0, len(prompt) :].tolist(), f"{arch}: prompt {i}"


@pytest.mark.parametrize("arch", ARCHS)
def test_penalties_and_bias_match_transformers_with_the_same_rule(arch, tiny_model_dirs):
    from transformers import AutoModelForCausalLM

    model_dir = tiny_model_dirs[arch]
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    engine = LLMEngine(EngineConfig(model=model_dir, dtype=torch.float32))
    requests = {f"adjusted-{i}": (prompt, adj) for i, (prompt, adj) in enumerate(zip(PROMPTS, ADJUSTED, strict=True))}
    requests["plain"] = (PROMPTS[0], {})
    for request_id, (prompt, adj) in requests.items():  # one batch: rows adjust alone
        engine.add_request(request_id, prompt, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True,
                                                              **adj))
    ours: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                ours[out.request_id] = out.output_token_ids
    for request_id, (prompt, adj) in requests.items():
        assert ours[request_id] == _reference(hf, prompt, **adj), f"{arch}: {request_id}"
    assert ours["adjusted-0"] != ours["plain"]  # the adjustments acted
    assert 11 not in ours["adjusted-0"]  # a bias of -100 bans
