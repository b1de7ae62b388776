"""OpenAI protocol: validation, conversion to SamplingParams, error bodies, SSE; no model.

The HTTP-level tests run the real app over `FakeEngine` (tests/unit/fake_engine.py)
in-process, so they check wiring and wire format, not generation.
"""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest
from fake_engine import FakeEngine
from pydantic import ValidationError

from elasticmoe.engine.async_llm import AsyncLLM
from elasticmoe.entrypoints.openai.api_server import build_app
from elasticmoe.entrypoints.openai.errors import OpenAIError, to_openai_error
from elasticmoe.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest
from elasticmoe.entrypoints.openai.responses import (
    ChatCompletionStreamResponse,
    CompletionResponse,
    DeltaMessage,
)
from elasticmoe.entrypoints.openai.serving import SSE_DONE, sse_event
from elasticmoe.sampling_params import SamplingParamError

MODEL = "fake"


# ---------------------------------------------------------------- pydantic models


@pytest.mark.parametrize(
    "prompt,expected",
    [("hi there", "hi there"), (["hi there"], "hi there"), ([5, 6, 7], [5, 6, 7]), ([[5, 6, 7]], [5, 6, 7])],
)
def test_prompt_forms(prompt, expected):
    assert CompletionRequest(model=MODEL, prompt=prompt).engine_prompt == expected


@pytest.mark.parametrize(
    "body,param",
    [
        ({"prompt": ["a", "b"]}, "prompt"),
        ({"prompt": []}, "prompt"),
        ({"prompt": [1, -2]}, "prompt"),
        ({"prompt": [[1, 2], [3]]}, "prompt"),
        ({"prompt": [[]]}, "prompt"),
        ({"prompt": [[1, -2]]}, "prompt"),
        ({"prompt": "x", "n": 17}, "n"),
        ({"prompt": "x", "echo": True, "logprobs": 1}, "echo"),
        ({"prompt": "x", "temperature": 2.5}, "temperature"),
        ({"prompt": "x", "temperature": "hot"}, "temperature"),
        ({"prompt": "x", "top_p": 0}, "top_p"),
        ({"prompt": "x", "max_tokens": 0}, "max_tokens"),
        ({"prompt": "x", "logprobs": 21}, "logprobs"),
        ({"prompt": "x", "stop": ["a", "b", "c", "d", "e"]}, "stop"),
        ({"prompt": "x", "stream_options": {"include_usage": True}}, "stream_options"),
        ({}, "prompt"),
    ],
)
def test_invalid_completion_requests_name_the_field(body, param):
    with pytest.raises(ValidationError) as info:
        CompletionRequest.model_validate({"model": MODEL, **body})
    err = _as_http_error(info.value)
    assert (err.status_code, err.param) == (400, param)


@pytest.mark.parametrize(
    "body,param",
    [
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "wizard", "content": "x"}]}, "messages"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]}, "messages"),
        ({"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, "top_logprobs"),
        (
            {"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 0},
            "max_completion_tokens",
        ),
    ],
)
def test_invalid_chat_requests_name_the_field(body, param):
    with pytest.raises(ValidationError) as info:
        ChatCompletionRequest.model_validate({"model": MODEL, **body})
    assert _as_http_error(info.value).param == param


def test_a_non_text_content_part_is_named_as_such():
    """Not pydantic's "Input should be a valid string" (the union's first member)."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": [{"type": "text", "text": "a"},
                                                                      {"type": "image_url", "image_url": {}}]}]}
    with pytest.raises(ValidationError) as info:
        ChatCompletionRequest.model_validate(body)
    err = _as_http_error(info.value)
    assert err.param == "messages" and "only text content parts" in str(err.message) and "image_url" in str(err.message)


def _as_http_error(exc: ValidationError) -> OpenAIError:
    from fastapi.exceptions import RequestValidationError

    errors = [{**e, "loc": ("body", *e["loc"])} for e in exc.errors()]
    return to_openai_error(RequestValidationError(errors))


def test_completion_to_sampling_params():
    req = CompletionRequest(
        model=MODEL,
        prompt="x",
        max_tokens=7,
        temperature=0,
        top_p=0.5,
        top_k=3,
        seed=1,
        stop="##",
        stop_token_ids=[9],
        ignore_eos=True,
        logprobs=2,
    )
    p = req.to_sampling_params()
    assert (p.max_tokens, p.temperature, p.top_p, p.top_k, p.seed) == (7, 0, 0.5, 3, 1)
    assert (p.stop, p.stop_token_ids, p.ignore_eos, p.logprobs) == (["##"], [9], True, 2)
    assert CompletionRequest(model=MODEL, prompt="x").to_sampling_params().max_tokens == 16  # OpenAI default


def test_penalties_and_logit_bias_reach_the_sampling_params():
    req = CompletionRequest.model_validate({"model": MODEL, "prompt": "x", "presence_penalty": 0.5,
                                            "frequency_penalty": -1, "logit_bias": {"5": 10, "17": -100},
                                            "repetition_penalty": 1.1, "min_tokens": 3})
    p = req.to_sampling_params()
    assert p.min_tokens == 3
    assert (p.presence_penalty, p.frequency_penalty, p.logit_bias) == (0.5, -1.0, {5: 10.0, 17: -100.0})
    assert p.repetition_penalty == 1.1
    assert p.adjusts_logits
    assert not CompletionRequest(model=MODEL, prompt="x").to_sampling_params().adjusts_logits


@pytest.mark.parametrize("bias,param", [
    ({"x": 1}, "logit_bias"), ({"-3": 1}, "logit_bias"), ({"1.5": 1}, "logit_bias"), ({"\u0663": 1}, "logit_bias"),
    ({"5": 100.5}, "logit_bias"), ({"5": -101}, "logit_bias"), ({"99999999999": 1}, "logit_bias"),
])
def test_bad_logit_bias_names_the_field(bias, param):
    with pytest.raises(SamplingParamError) as info:
        CompletionRequest.model_validate({"model": MODEL, "prompt": "x", "logit_bias": bias}).to_sampling_params()
    assert info.value.param == param


def test_chat_to_sampling_params():
    msgs = [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]
    req = ChatCompletionRequest(model=MODEL, messages=msgs, max_tokens=5, max_completion_tokens=9)
    assert req.to_sampling_params().max_tokens == 9  # max_completion_tokens wins
    assert req.to_sampling_params().logprobs is None
    assert req.template_messages() == [{"role": "user", "content": "a\nb"}]
    req = ChatCompletionRequest(model=MODEL, messages=msgs, logprobs=True, top_logprobs=3)
    assert req.to_sampling_params().logprobs == 3
    assert ChatCompletionRequest(model=MODEL, messages=msgs, logprobs=True).to_sampling_params().logprobs == 0
    assert ChatCompletionRequest(model=MODEL, messages=msgs).to_sampling_params().max_tokens is None


def test_unknown_fields_are_ignored():
    req = CompletionRequest.model_validate({"model": MODEL, "prompt": "x", "foo": 1, "metadata": {"a": "b"}})
    assert req.prompt == "x"


@pytest.mark.parametrize("request_class,body", [
    (CompletionRequest, {"prompt": "x"}),
    (ChatCompletionRequest, {"messages": [{"role": "user", "content": "x"}]}),
])
@pytest.mark.parametrize("field,value", [
    ("prompt_logprobs", 1), ("guided_whitespace_pattern", "[ ]*"),
])
def test_unimplemented_parameters_are_refused_by_name_unless_neutral(request_class, body, field, value):
    """An output-changing parameter the server does not implement is a 400 naming it, never ignored
    (the answer would silently lack what was asked for); null or a neutral value is accepted."""
    with pytest.raises(ValidationError) as info:
        request_class.model_validate({"model": MODEL, **body, field: value})
    err = _as_http_error(info.value)
    assert (err.status_code, err.param) == (400, field)
    assert "not supported" in str(err.message)
    request_class.model_validate({"model": MODEL, **body, field: None})


def test_a_refused_value_is_shown_bounded_however_large_or_deep():
    deep: list = []
    inner = deep
    for _ in range(5000):  # deeper than the interpreter's recursion limit
        inner.append([])
        inner = inner[0]
    for value in (deep, list(range(100_000)), {"schema": "x" * 10_000}):
        with pytest.raises(ValidationError) as info:
            CompletionRequest.model_validate({"model": MODEL, "prompt": "x", "prompt_logprobs": value})
        err = _as_http_error(info.value)
        assert err.param == "prompt_logprobs" and len(str(err.message)) < 300


@pytest.mark.parametrize("request_class,body,field,value", [
    (CompletionRequest, {"prompt": "x"}, "best_of", 2),
    (CompletionRequest, {"prompt": "x"}, "suffix", "tail"),
    (ChatCompletionRequest, {"messages": [{"role": "user", "content": "x"}]}, "tool_choice", "required"),
    (ChatCompletionRequest, {"messages": [{"role": "user", "content": "x"}]}, "functions", [{"name": "f"}]),
    (ChatCompletionRequest, {"messages": [{"role": "user", "content": "x"}]}, "function_call", {"name": "f"}),
    (ChatCompletionRequest, {"messages": [{"role": "user", "content": "x"}]}, "modalities", ["text", "audio"]),
])
def test_unimplemented_parameters_of_one_endpoint_are_refused_by_name(request_class, body, field, value):
    with pytest.raises(ValidationError) as info:
        request_class.model_validate({"model": MODEL, **body, field: value})
    assert _as_http_error(info.value).param == field


@pytest.mark.parametrize("extra", [
    {"repetition_penalty": 1.0, "min_tokens": 0,
     "min_p": 0, "bad_words": [], "include_stop_str_in_output": False, "best_of": 1, "suffix": ""},
])
def test_neutral_values_of_unimplemented_parameters_are_accepted(extra):
    """What SDKs send by default (e.g. a penalty of 0) asks for nothing, so it is served."""
    CompletionRequest.model_validate({"model": MODEL, "prompt": "x", **extra})
    chat = {k: v for k, v in extra.items() if k not in ("best_of", "suffix")}
    ChatCompletionRequest.model_validate({"model": MODEL, "messages": [{"role": "user", "content": "x"}], **chat,
                                          "response_format": {"type": "text"}, "tools": [], "tool_choice": "none",
                                          "function_call": "auto", "modalities": ["text"]})
    ChatCompletionRequest.model_validate({"model": MODEL, "messages": [{"role": "user", "content": "x"}],
                                          "tool_choice": "auto"})  # no tools: a text answer


# ---------------------------------------------------------------- errors and SSE


def test_error_classification():
    err = to_openai_error(SamplingParamError("top_k", "bad"))
    assert (err.status_code, err.type, err.param) == (400, "BadRequestError", "top_k")
    body = err.to_response().model_dump()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    secret = to_openai_error(RuntimeError("/secret/path token=abc"))
    assert secret.status_code == 500 and "secret" not in secret.message
    assert to_openai_error(ValueError("no param")).status_code == 500


def test_sse_format():
    chunk = ChatCompletionStreamResponse(
        id="chatcmpl-1", created=1, model=MODEL, choices=[{"delta": DeltaMessage(content="hi")}]
    )
    event = sse_event(chunk)
    assert event.startswith("data: ") and event.endswith("\n\n") and event.count("\n") == 2
    payload = json.loads(event[len("data: ") :])
    assert payload["choices"][0]["delta"] == {"content": "hi"}  # unset role is omitted, not null
    assert payload["object"] == "chat.completion.chunk"
    assert SSE_DONE == "data: [DONE]\n\n"
    assert json.loads(DeltaMessage().model_dump_json()) == {}


# ---------------------------------------------------------------- the app over a fake engine


@pytest.fixture(scope="module")
def fake_llm():
    llm = AsyncLLM(FakeEngine())
    llm.start()
    yield llm
    llm.shutdown()


def _request(fake_llm, method: str, path: str, **kwargs) -> httpx.Response:
    async def main() -> httpx.Response:
        transport = httpx.ASGITransport(build_app(fake_llm, MODEL))
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            return await client.request(method, path, **kwargs)

    return asyncio.run(main())


def _events(text: str) -> list[dict | str]:
    assert text.endswith(SSE_DONE)
    events = [e for e in text.split("\n\n") if e]
    assert all(e.startswith("data: ") for e in events)
    return [e[6:] if e == SSE_DONE.strip() else json.loads(e[6:]) for e in events]


def test_completion_response_shape(fake_llm):
    r = _request(
        fake_llm,
        "POST",
        "/v1/completions",
        json={"model": MODEL, "prompt": "a bb", "max_tokens": 3, "logprobs": 1},
    )
    assert r.status_code == 200
    body = CompletionResponse.model_validate(r.json())
    assert body.id.startswith("cmpl-") and body.object == "text_completion" and body.created > 0
    choice = body.choices[0]
    assert (choice.text, choice.finish_reason) == ("w0 w1 w2 ", "length")
    assert choice.logprobs.tokens == ["w0 ", "w1 ", "w2 "]
    assert choice.logprobs.text_offset == [0, 3, 6]
    assert choice.logprobs.top_logprobs[0] == {"w0 ": -0.5}
    assert body.usage.model_dump() == {"prompt_tokens": 2, "completion_tokens": 3, "total_tokens": 5,
                                     "prompt_tokens_details": {"cached_tokens": 0}}


def test_chat_stream_shape(fake_llm):
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 2,
        "stream": True,
        "stream_options": {"include_usage": True},
        "logprobs": True,
    }
    r = _request(fake_llm, "POST", "/v1/chat/completions", json=body)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = _events(r.text)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert len({c["id"] for c in chunks}) == 1 and chunks[0]["id"].startswith("chatcmpl-")
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks[:-1]) == "w0 w1 "
    assert chunks[1]["choices"][0]["logprobs"]["content"][0]["token"] == "w0 "
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 2
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)


def test_http_errors(fake_llm):
    r = _request(fake_llm, "POST", "/v1/completions", json={"model": MODEL, "prompt": "x", "top_p": 2})
    assert r.status_code == 400 and r.json()["error"]["param"] == "top_p"
    r = _request(
        fake_llm,
        "POST",
        "/v1/completions",
        content=b'{"model": ',
        headers={"content-type": "application/json"},
    )
    assert (
        r.status_code == 400 and r.json()["error"]["param"] is None and "JSON" in r.json()["error"]["message"]
    )
    r = _request(fake_llm, "POST", "/v1/completions", json={"model": "other", "prompt": "x"})
    assert r.status_code == 404 and r.json()["error"] == {
        "message": "The model `other` does not exist.",
        "type": "NotFoundError",
        "param": "model",
        "code": 404,
    }
    long_chat = {"model": MODEL, "messages": [{"role": "user", "content": "x " * 100}]}
    r = _request(fake_llm, "POST", "/v1/chat/completions", json=long_chat)
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"  # engine said "prompt"


def test_unexpected_errors_are_opaque_500s(fake_llm):
    def explode() -> None:
        raise RuntimeError("internal detail /opt/secret")

    fake_llm.engine.add_hook = explode
    try:
        r = _request(fake_llm, "POST", "/v1/completions", json={"model": MODEL, "prompt": "x"})
    finally:
        fake_llm.engine.add_hook = None
    assert r.status_code == 500
    assert r.json()["error"]["type"] == "InternalServerError" and "secret" not in r.text
    assert (
        _request(fake_llm, "POST", "/v1/completions", json={"model": MODEL, "prompt": "x"}).status_code == 200
    )


def test_models_health_metrics(fake_llm):
    models = _request(fake_llm, "GET", "/v1/models").json()
    assert (
        models["object"] == "list"
        and models["data"][0]["id"] == MODEL
        and models["data"][0]["object"] == "model"
    )
    assert _request(fake_llm, "GET", "/health").status_code == 200
    assert _request(fake_llm, "GET", "/ready").status_code == 200
    text = _request(fake_llm, "GET", "/metrics").text
    assert "elasticmoe_http_requests_total" in text and "elasticmoe_e2e_request_latency_seconds" in text


def test_health_is_503_when_engine_is_down():
    llm = AsyncLLM(FakeEngine())  # never started
    assert _request(llm, "GET", "/health").status_code == 503
    assert _request(llm, "GET", "/ready").status_code == 503


def test_engine_failure_mid_stream_ends_with_an_error_event():
    engine = FakeEngine()

    def crash_on_third_step() -> None:
        if engine.num_steps == 3:
            raise RuntimeError("kaboom at /internal/path")

    engine.step_hook = crash_on_third_step
    llm = AsyncLLM(engine)
    llm.start()
    try:
        body = {"model": MODEL, "prompt": "x", "max_tokens": 10, "stream": True}
        r = _request(llm, "POST", "/v1/completions", json=body)
    finally:
        llm.shutdown()
    assert r.status_code == 200  # headers were sent with the first token
    events = _events(r.text)
    assert events[-1] == "[DONE]"
    assert events[-2]["error"]["type"] == "InternalServerError" and "kaboom" not in r.text
    assert [e["choices"][0]["text"] for e in events[:-2]] == ["w0 ", "w1 "]
