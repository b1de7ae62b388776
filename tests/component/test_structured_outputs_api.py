"""Structured outputs over the OpenAI API of the single-process server with a real engine,
in-process: each spelling constrains the answer, a stream's deltas add up to the same answer, `n`
choices each match, and a bad constraint is a 400 in OpenAI's error format naming the field,
after which the server still answers."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
from in_process_server import post, serving, sse_events

MODEL = "tiny"
SCHEMA = {"type": "object", "additionalProperties": False, "required": ["city", "rank"],
          "properties": {"city": {"type": "string", "maxLength": 10}, "rank": {"type": "integer", "minimum": 1,
                                                                             "maximum": 99}}}
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Answer in JSON."}], "max_tokens": 64,
        "temperature": 0.8, "seed": 3}


@pytest.fixture(scope="module")
def app(tiny_model_dir):
    with serving(tiny_model_dir, MODEL) as app:
        yield app


def _json_schema_format(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema, "strict": True}}


def test_a_chat_answer_matches_its_json_schema(app):
    response = post(app, "/v1/chat/completions", {**CHAT, "response_format": _json_schema_format(SCHEMA), "n": 2})
    assert response.status_code == 200, response.text
    for choice in response.json()["choices"]:
        jsonschema.validate(json.loads(choice["message"]["content"]), SCHEMA)
        assert choice["finish_reason"] == "stop"


def test_a_json_object_stream_adds_up_to_the_non_streamed_answer(app):
    body = {**CHAT, "response_format": {"type": "json_object"}, "max_tokens": 200,
            "structured_outputs": None, "temperature": 0}
    whole = post(app, "/v1/chat/completions", body).json()["choices"][0]
    streamed = post(app, "/v1/chat/completions", {**body, "stream": True})
    events = sse_events(streamed)
    text = "".join(e["choices"][0]["delta"].get("content") or "" for e in events if e["choices"])
    assert text == whole["message"]["content"] and text.startswith("{")
    if whole["finish_reason"] == "stop":
        assert isinstance(json.loads(text), dict)


@pytest.mark.parametrize("fields,check", [
    ({"guided_choice": ["alpha", "beta"]}, lambda t: t in ("alpha", "beta")),
    ({"guided_regex": "[0-9]{2}:[0-9]{2}"}, lambda t: re.fullmatch("[0-9]{2}:[0-9]{2}", t)),
    ({"structured_outputs": {"grammar": 'start: "yes" | "no" | "maybe"'}}, lambda t: t in ("yes", "no", "maybe")),
    ({"structured_outputs": {"json": SCHEMA}}, lambda t: jsonschema.validate(json.loads(t), SCHEMA) is None),
])
def test_a_completion_matches_each_vllm_spelling(app, fields, check):
    response = post(app, "/v1/completions", {"model": MODEL, "prompt": "The value is", "max_tokens": 64,
                                               "temperature": 1.0, "seed": 7, **fields})
    assert response.status_code == 200, response.text
    choice = response.json()["choices"][0]
    assert check(choice["text"]) and choice["finish_reason"] == "stop", choice


@pytest.mark.parametrize("path,fields,param", [
    ("/v1/chat/completions", {"response_format": _json_schema_format({"type": "nonsense"})}, "response_format"),
    ("/v1/chat/completions", {"response_format": {"type": "yaml"}}, "response_format"),
    ("/v1/completions", {"guided_regex": "(unclosed"}, "guided_regex"),
    ("/v1/completions", {"guided_choice": "not-a-list"}, "guided_choice"),
    ("/v1/completions", {"guided_regex": "a", "guided_choice": ["b"]}, "guided_choice"),
    ("/v1/completions", {"structured_outputs": {"whitespace_pattern": " "}}, "structured_outputs.whitespace_pattern"),
])
def test_a_bad_constraint_is_a_400_naming_the_field_and_the_server_goes_on(app, path, fields, param):
    body = {"model": MODEL, "max_tokens": 4, **fields}
    body.update({"prompt": "x"} if path == "/v1/completions" else {"messages": [{"role": "user", "content": "x"}]})
    response = post(app, path, body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and error["code"] == 400, error
    ok = post(app, "/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 2})
    assert ok.status_code == 200
