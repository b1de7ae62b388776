"""vLLM's `min_tokens` in the engine: no EOS, stop token or stop string ends a request before it
has that many output tokens, and the first stop after it ends the request as it would have ended
there. The sampler holds the stop tokens back; stop strings are looked for only in text that ends
after the minimum (text before can never stop the request, later)."""

from __future__ import annotations

import pytest
import torch

from elasticmoe.config import EngineConfig
from elasticmoe.engine.llm_engine import LLMEngine
from elasticmoe.sampling_params import SamplingParamError, SamplingParams

PROMPT = [11, 22, 33, 44, 55]


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    return LLMEngine(EngineConfig(model=tiny_model_dir, dtype=torch.float32))


def _run(engine: LLMEngine, params: SamplingParams):
    engine.add_request("r", PROMPT, params)
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                return out
    raise AssertionError("never finished")


def test_eos_is_held_back_until_the_minimum(engine):
    eos = sorted(engine.output_processor.eos_token_ids)[0]
    forced = {eos: 100.0}  # EOS is every step's choice once allowed
    assert _run(engine, SamplingParams(temperature=0.0, max_tokens=20, logit_bias=forced)).output_token_ids == [eos]
    out = _run(engine, SamplingParams(temperature=0.0, max_tokens=20, logit_bias=forced, min_tokens=5))
    assert len(out.output_token_ids) == 6 and out.output_token_ids[-1] == eos and eos not in out.output_token_ids[:5]
    assert out.finish_reason == "stop"
    ignored = _run(engine, SamplingParams(temperature=0.0, max_tokens=8, logit_bias=forced, min_tokens=5,
                                          ignore_eos=True))
    assert ignored.output_token_ids == [eos] * 8  # ignore_eos: EOS is an ordinary token, not held back


def test_a_stop_token_is_held_back_until_the_minimum(engine):
    out = _run(engine, SamplingParams(temperature=0.0, max_tokens=20, stop_token_ids=[7], logit_bias={7: 100.0},
                                      min_tokens=3, ignore_eos=True))
    assert out.output_token_ids[3:] == [7] and 7 not in out.output_token_ids[:3]
    assert (out.finish_reason, out.stop_reason) == ("stop", 7)


def _texts(engine: LLMEngine, params: SamplingParams) -> list[str]:
    """The request's whole text after each of its output tokens (the engine's incremental text, which
    waits for a partial UTF-8 sequence to complete)."""
    engine.add_request("r", PROMPT, params)
    texts = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            texts += [out.text] * len(out.new_token_ids)
    return texts


def test_a_stop_string_counts_only_once_it_ends_after_the_minimum(engine):
    texts = _texts(engine, SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True))
    full, k = texts[-1], 4
    # a character the first k tokens' text holds and the later text holds again
    early, late = texts[k - 1], full[len(texts[k - 1]) :]
    stop = next(ch for ch in early if ch.strip() and ch != "\ufffd" and ch in late)
    cut = full.find(stop, len(early))  # the first match ending after the minimum's text
    out = _run(engine, SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, stop=[stop], min_tokens=k))
    assert out.text == full[:cut] and out.stop_reason == stop
    assert len(out.output_token_ids) == next(i for i, text in enumerate(texts) if len(text) > cut) + 1
    without = _run(engine, SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, stop=[stop]))
    assert len(without.output_token_ids) <= k  # without the minimum it stops inside the first k tokens


def test_min_tokens_above_max_tokens_is_refused_by_name():
    with pytest.raises(SamplingParamError) as info:
        SamplingParams(max_tokens=4, min_tokens=5)
    assert info.value.param == "min_tokens"
