"""The sampler's penalties and logit bias against values computed by hand, and what they leave
alone: other rows, the caller's logits, and the reported logprobs (the model's own distribution).
OpenAI's rule: `logit[t] - frequency * count[t] - presence * (count[t] > 0) + bias[t]`, counts over
the output generated so far, never the prompt's. vLLM's order with its repetition penalty: the
bias, then the repetition penalty on every token of the prompt and the output, then the two others."""

from __future__ import annotations

import math

import torch

from elasticmoe.engine.request import Request
from elasticmoe.engine.sampler import Sampler, _adjusted_logits
from elasticmoe.sampling_params import SamplingParams


def _request(prompt: list[int], output: list[int], **params) -> Request:
    return Request("r", prompt + output, len(prompt), SamplingParams(temperature=0.0, **params), 10_000)


def test_penalties_count_the_output_only_and_bias_adds():
    logits = torch.tensor([[1.0, 2.0, 3.0, 4.0, 5.0]])
    # prompt holds token 4 (not counted); the output holds 3 twice and 1 once
    req = _request([4, 4], [3, 1, 3], presence_penalty=0.5, frequency_penalty=0.25, logit_bias={0: 10.0, 2: -1.5})
    got = _adjusted_logits(logits, [req])[0].tolist()
    want = [1.0 + 10.0, 2.0 - 0.25 - 0.5, 3.0 - 1.5, 4.0 - 2 * 0.25 - 0.5, 5.0]
    assert all(math.isclose(g, w, abs_tol=1e-6) for g, w in zip(got, want, strict=True))
    assert logits.tolist() == [[1.0, 2.0, 3.0, 4.0, 5.0]]  # the caller's logits are untouched


def test_negative_penalties_favour_repeats_and_rows_without_adjustments_are_shared():
    logits = torch.tensor([[0.0, 1.0, 0.5], [0.0, 1.0, 0.5]])
    plain = _request([0], [2])
    repeat = _request([0], [2], frequency_penalty=-1.0)
    adjusted = _adjusted_logits(logits, [plain, repeat])
    assert adjusted[0].tolist() == [0.0, 1.0, 0.5] and adjusted[1].tolist() == [0.0, 1.0, 1.5]
    assert _adjusted_logits(logits, [plain, plain]) is logits  # nothing to adjust: no copy


def test_greedy_choice_follows_the_adjusted_logits_and_logprobs_the_model():
    sampler = Sampler(seed=0)
    logits = torch.tensor([[0.0, 3.0, 1.0, 2.0]])
    banned = _request([0], [], logit_bias={1: -100.0}, logprobs=2)
    result = sampler(logits, [banned])
    assert result.token_ids == [3]  # 1 is banned, 3 is next best
    chosen, top = result.logprobs[0]
    model = logits[0].log_softmax(-1)
    assert math.isclose(chosen, float(model[3]), abs_tol=1e-6)
    assert [t for t, _ in top] == [1, 3]  # the model's own top 2, the banned token first
    # a presence penalty on the repeated best token hands the choice to the runner-up
    assert sampler(logits, [_request([0], [1], presence_penalty=2.0)]).token_ids == [3]
    assert sampler(logits, [_request([0], [1], presence_penalty=0.9)]).token_ids == [1]


def test_a_forced_token_wins_under_sampling_too():
    sampler = Sampler(seed=0)
    logits = torch.tensor([[0.0, 3.0, 1.0, 2.0]])
    forced = Request("r", [0], 1, SamplingParams(temperature=1.0, logit_bias={0: 100.0}), 10_000)
    assert {sampler(logits, [forced]).token_ids[0] for _ in range(50)} == {0}


def test_repetition_penalty_covers_prompt_and_output_after_the_bias():
    logits = torch.tensor([[2.0, -2.0, 3.0, 1.0, -1.0, 0.5]])
    # prompt holds 0 and 1, output holds 2 (twice) and 5; 3 and 4 are unseen
    req = _request([0, 1], [2, 5, 2], repetition_penalty=2.0, frequency_penalty=0.5, logit_bias={5: -1.0, 3: 1.0})
    got = _adjusted_logits(logits, [req])[0].tolist()
    want = [2.0 / 2, -2.0 * 2, 3.0 / 2 - 2 * 0.5, 1.0 + 1.0, -1.0, (0.5 - 1.0) * 2 - 0.5]
    assert all(math.isclose(g, w, abs_tol=1e-6) for g, w in zip(got, want, strict=True)), (got, want)
