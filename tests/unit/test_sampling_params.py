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
