"""Tool calls over the chat API of the single-process server with a real engine, in-process: a
named `tool_choice` answers one call of that function whose arguments match its schema, "required"
answers calls of the tools (one with `parallel_tool_calls: false`), streams carry the same calls,
earlier turns' calls and tool answers render, and what cannot be served is a 400 naming the field.
The chat template is given the tools (a template that shows them: the last test)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import jsonschema
import pytest
from in_process_server import post, serving, sse_events

from elasticmoe.tokenizer import Tokenizer

MODEL = "tiny"
WEATHER = {"type": "object", "additionalProperties": False, "required": ["city", "unit"],
           "properties": {"city": {"type": "string", "maxLength": 12}, "unit": {"enum": ["C", "F"]}}}
CLOCK = {"type": "object", "additionalProperties": False, "required": ["zone"],
         "properties": {"zone": {"type": "string", "maxLength": 6}}}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city.",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "parameters": CLOCK}}]
SCHEMAS = {"get_weather": WEATHER, "get_time": CLOCK}
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Weather in Oslo?"}], "max_tokens": 96,
        "tools": TOOLS, "temperature": 0.7, "seed": 11}
NAMED = {"type": "function", "function": {"name": "get_weather"}}


@pytest.fixture(scope="module")
def app(tiny_model_dir):
    with serving(tiny_model_dir, MODEL) as app:
        yield app


def _chat(app, body: dict) -> dict:
    response = post(app, "/v1/chat/completions", body)
    assert response.status_code == 200, response.text
    return response.json()


def _events(app, body: dict) -> list[dict]:
    response = post(app, "/v1/chat/completions", {**body, "stream": True})
    assert response.status_code == 200, response.text
    return sse_events(response)


def _check_calls(calls: list[dict]) -> None:
    for call in calls:
        assert call["type"] == "function" and call["id"].startswith("call")
        jsonschema.validate(json.loads(call["function"]["arguments"]), SCHEMAS[call["function"]["name"]])


def test_a_named_tool_choice_answers_one_call_of_that_function(app):
    choice = _chat(app, {**CHAT, "tool_choice": NAMED, "n": 2})["choices"]
    for c in choice:
        assert c["message"]["content"] is None and c["finish_reason"] == "stop"  # OpenAI's, for a forced call
        assert [call["function"]["name"] for call in c["message"]["tool_calls"]] == ["get_weather"]
        _check_calls(c["message"]["tool_calls"])


@pytest.mark.parametrize("parallel", [True, False])
def test_required_answers_calls_of_the_tools(app, parallel):
    """The random model may append calls until max_tokens with parallel calls allowed: such an
    answer comes back as its text ("length"); with one call allowed every answer ends."""
    finished = 0
    for seed in range(4):
        c = _chat(app, {**CHAT, "tool_choice": "required", "parallel_tool_calls": parallel, "seed": seed,
                        "max_tokens": 200})["choices"][0]
        if c["finish_reason"] == "length" and parallel:
            assert c["message"]["content"].startswith("[") and c["message"]["tool_calls"] == []
            continue
        assert c["finish_reason"] == "tool_calls", c
        calls = c["message"]["tool_calls"]
        assert calls and (parallel or len(calls) == 1)
        _check_calls(calls)
        finished += 1
    assert finished >= (1 if parallel else 4)


@pytest.mark.parametrize("tool_choice", [NAMED, "required"])
def test_a_stream_carries_the_same_calls(app, tool_choice):
    body = {**CHAT, "tool_choice": tool_choice, "temperature": 0, "max_tokens": 160, "parallel_tool_calls": False}
    whole = _chat(app, body)["choices"][0]
    assert whole["message"]["tool_calls"], whole
    events = _events(app, body)
    deltas = [d for e in events for d in e["choices"][0]["delta"].get("tool_calls", []) if e["choices"]]
    calls: dict[int, dict] = {}
    for d in deltas:
        call = calls.setdefault(d["index"], {"id": d.get("id"), "name": d["function"].get("name"), "arguments": ""})
        call["arguments"] += d["function"].get("arguments", "")
    assert [(c["name"], c["arguments"]) for c in calls.values()] == [
        (c["function"]["name"], c["function"]["arguments"]) for c in whole["message"]["tool_calls"]]
    assert all(c["id"] for c in calls.values())
    assert events[-1]["choices"][0]["finish_reason"] == whole["finish_reason"]
    assert not any(e["choices"][0]["delta"].get("content") for e in events if e["choices"])


def test_none_answers_text_and_earlier_calls_render(app):
    messages = [{"role": "user", "content": "Weather in Oslo?"},
                {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
                    "name": "get_weather", "arguments": '{"city": "Oslo", "unit": "C"}'}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "4 degrees"}]
    c = _chat(app, {**CHAT, "messages": messages, "tool_choice": "none", "max_tokens": 8})["choices"][0]
    assert isinstance(c["message"]["content"], str) and c["message"]["tool_calls"] == []


def test_a_call_cut_by_max_tokens_comes_back_as_text(app):
    c = _chat(app, {**CHAT, "tool_choice": NAMED, "max_tokens": 3})["choices"][0]
    assert c["finish_reason"] == "length" and c["message"]["tool_calls"] == []
    assert c["message"]["content"].startswith("{")


@pytest.mark.parametrize("fields,param", [
    ({}, "tool_choice"),  # "auto", the default with tools: no parser of the model's format
    ({"tool_choice": "auto"}, "tool_choice"),
    ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tools": None, "tool_choice": "required"}, "tool_choice"),
    ({"tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
    ({"tool_choice": "required", "tools": [{"type": "function", "function": {"name": "bad name"}}]}, "tools"),
    ({"tool_choice": "required", "tools": [{"type": "function", "function": {
        "name": "f", "parameters": {"type": "nonsense"}}}]}, "tools"),
    ({"tool_choice": "required", "tools": [{"type": "retrieval"}]}, "tools"),
    ({"tool_choice": "required", "tools": [TOOLS[0]] * 129}, "tools"),
    ({"tool_choice": "sometimes"}, "tool_choice"),
    ({"functions": [{"name": "f"}]}, "functions"),  # the legacy form stays refused
])
def test_what_cannot_be_served_is_a_400_naming_the_field(app, fields, param):
    body = {k: v for k, v in {**CHAT, **fields}.items() if v is not None}
    response = post(app, "/v1/chat/completions", body)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param, response.json()


def test_the_template_is_given_the_tools_and_earlier_calls(tiny_model_dir, tmp_path):
    """A template that renders tools (as real models' do) shows the tools and a turn's calls."""
    model = Path(shutil.copytree(tiny_model_dir, tmp_path / "model"))
    (model / "chat_template.jinja").write_text(
        "{% if tools %}TOOLS:{% for t in tools %}{{ t.function.name }};{% endfor %}\n{% endif %}"
        "{% for m in messages %}{{ m.role }}: {{ m.content }}"
        "{% for c in m.tool_calls or [] %}CALL {{ c.function.name }}({{ c.function.arguments }}){% endfor %}\n"
        "{% endfor %}assistant:")
    tokenizer = Tokenizer(model)
    messages = [{"role": "user", "content": "hi"},
                {"role": "assistant", "content": "", "tool_calls": [{"id": "c", "type": "function", "function": {
                    "name": "get_time", "arguments": "{}"}}]}]
    text = tokenizer.decode(tokenizer.apply_chat_template(messages, TOOLS), skip_special_tokens=False)
    assert "TOOLS:get_weather;get_time;" in text and "CALL get_time({})" in text
