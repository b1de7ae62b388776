"""vLLM's `allowed_token_ids` and `min_p` in the sampler, against values worked by hand: allowed
tokens mask everything else before the bias and penalties (greedy rows too); min-p drops the tokens
less likely than min_p times the most likely one after temperature, so they are never drawn."""

from __future__ import annotations

import math

import pytest
import torch

from elasticmoe.engine.request import Request
from elasticmoe.engine.sampler import Sampler, _adjusted_logits, _apply_min_p
from elasticmoe.sampling_params import SamplingParamError, SamplingParams


def _request(temperature: float = 0.0, seed: int | None = None, **params) -> Request:
    return Request("r", [1, 2], 2, SamplingParams(temperature=temperature, seed=seed, **params), 10_000)


def test_allowed_tokens_mask_the_rest_before_the_bias():
    logits = torch.tensor([[5.0, 1.0, 2.0, 3.0]])
    req = _request(allowed_token_ids=[1, 2], logit_bias={2: -1.5, 0: 10.0})
    got = _adjusted_logits(logits, [req])[0].tolist()
    assert got[0] == -math.inf and got[3] == -math.inf and got[1:3] == [1.0, 0.5]
    assert Sampler()(logits, [req]).token_ids == [1]  # greedy: the best allowed token


def test_min_p_keeps_what_is_at_least_min_p_times_the_most_likely():
    # probabilities 0.5, 0.25, 0.125, 0.125 at temperature 1
    logits = torch.log(torch.tensor([[0.5, 0.25, 0.125, 0.125]]))
    kept = _apply_min_p(logits, torch.tensor([0.5]))[0]
    assert [math.isfinite(x) for x in kept.tolist()] == [True, True, False, False]
    assert torch.isfinite(_apply_min_p(logits, torch.tensor([0.0]))[0]).all()


def test_tokens_below_min_p_are_never_drawn_and_temperature_comes_first():
    logits = torch.log(torch.tensor([[0.4, 0.3, 0.2, 0.1]]))
    drawn = {Sampler()(logits, [_request(1.0, seed=s, min_p=0.6)]).token_ids[0] for s in range(200)}
    assert drawn == {0, 1}  # 0.2 and 0.1 are below 0.6 * 0.4
    # at temperature 4 the distribution flattens: every probability is above 0.6 of the largest
    hot = {Sampler()(logits, [_request(4.0, seed=s, min_p=0.6)]).token_ids[0] for s in range(200)}
    assert hot == {0, 1, 2, 3}


@pytest.mark.parametrize("fields,param", [({"min_p": 1.5}, "min_p"), ({"min_p": -0.1}, "min_p"),
                                          ({"allowed_token_ids": []}, "allowed_token_ids"),
                                          ({"allowed_token_ids": [-1]}, "allowed_token_ids")])
def test_bad_values_name_the_field(fields, param):
    with pytest.raises(SamplingParamError) as info:
        SamplingParams(**fields)
    assert info.value.param == param


def test_allowed_tokens_past_the_vocabulary_are_refused():
    with pytest.raises(SamplingParamError) as info:
        SamplingParams(allowed_token_ids=[3, 99]).check_vocabulary(50)
    assert info.value.param == "allowed_token_ids"


def test_bad_words_ban_the_token_that_would_complete_them():
    from elasticmoe.engine.sampler import _banned_next

    words = [[7], [3, 4], [1, 2, 9]]
    assert _banned_next(words, []) == [7]
    assert _banned_next(words, [5, 3]) == [7, 4]
    assert _banned_next(words, [1, 2]) == [7, 9]
    assert _banned_next(words, [2]) == [7]  # the output must hold the whole prefix
    logits = torch.zeros(1, 10)
    row = _adjusted_logits(logits, [Request("r", [1, 2, 3], 2, SamplingParams(bad_words_token_ids=words), 100)])[0]
    assert [i for i, x in enumerate(row.tolist()) if x == -math.inf] == [4, 7]  # output [3]: "3 4" is next


def test_greedy_takes_the_first_of_equal_best_tokens_as_argmax_does():
    # The sampler's row maximum must pick what argmax picks: the first of ties, NaN as largest.
    logits = torch.tensor([[1.0, 3.0, 3.0, 0.0], [2.0, float("nan"), 5.0, float("nan")], [-1.0, -1.0, -1.0, -1.0]])
    reqs = [_request() for _ in range(3)]
    assert Sampler()(logits, reqs).token_ids == logits.argmax(dim=-1).tolist() == [1, 1, 0]
