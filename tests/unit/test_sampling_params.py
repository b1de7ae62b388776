import pytest

from elasticmoe.sampling_params import SamplingParamError, SamplingParams


@pytest.mark.parametrize(
    "kwargs,param",
    [
        (dict(temperature=-1.0), "temperature"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_p=1.5), "top_p"),
        (dict(top_k=-2), "top_k"),
        (dict(max_tokens=0), "max_tokens"),
        (dict(stop=[""]), "stop"),
        (dict(stop_token_ids=["a"]), "stop_token_ids"),
        (dict(stop_token_ids=[-1]), "stop_token_ids"),
        (dict(logprobs=21), "logprobs"),
        (dict(seed="x"), "seed"),
        (dict(presence_penalty=2.5), "presence_penalty"),
        (dict(presence_penalty=float("nan")), "presence_penalty"),
        (dict(frequency_penalty=-2.01), "frequency_penalty"),
        (dict(frequency_penalty=True), "frequency_penalty"),
        (dict(logit_bias={5: 100.5}), "logit_bias"),
        (dict(logit_bias={5: float("inf")}), "logit_bias"),
        (dict(logit_bias={-1: 1.0}), "logit_bias"),
        (dict(logit_bias={"5": 1.0}), "logit_bias"),
        (dict(logit_bias={i: 1.0 for i in range(1025)}), "logit_bias"),
        (dict(repetition_penalty=0.0), "repetition_penalty"),
        (dict(repetition_penalty=-1.0), "repetition_penalty"),
        (dict(repetition_penalty=float("nan")), "repetition_penalty"),
        (dict(repetition_penalty=101.0), "repetition_penalty"),
        (dict(min_tokens=-1), "min_tokens"),
        (dict(min_tokens=1.5), "min_tokens"),
        (dict(max_tokens=4, min_tokens=5), "min_tokens"),
    ],
)
def test_invalid_values_name_the_field(kwargs, param):
    with pytest.raises(SamplingParamError) as info:
        SamplingParams(**kwargs)
    assert info.value.param == param
    assert isinstance(info.value, ValueError)


def test_defaults_and_normalisation():
    p = SamplingParams(stop="###", top_k=-1, temperature=0.0)
    assert p.stop == ["###"]
    assert p.top_k == 0
    assert p.is_greedy


def test_request_errors_survive_pickling_with_their_field():
    import pickle

    from elasticmoe.errors import InvalidRequestError

    for err in (InvalidRequestError("prompt", "too long"), SamplingParamError("temperature", "bad")):
        back = pickle.loads(pickle.dumps(err))  # how errors cross Ray actor boundaries
        assert type(back) is type(err) and back.param == err.param and str(back) == str(err)
