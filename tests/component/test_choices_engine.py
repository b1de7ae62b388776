"""`n` choices against the single-process server with a real engine, in-process: greedy choices
equal the one-choice answer, seeded choice i equals a one-choice request with seed + i, a stream
carries every choice by index with the usage of all. (A client leaving mid-stream: over a real socket
in tests/e2e/test_single_server.py; httpx's in-process transport reads the whole answer first.)"""

from __future__ import annotations

import json

import pytest
from in_process_server import post, serving

MODEL = "tiny"
BODY = {"model": MODEL, "prompt": "the expert model", "max_tokens": 8, "ignore_eos": True}


@pytest.fixture(scope="module")
def app(tiny_model_dir):
    with serving(tiny_model_dir, MODEL) as app:
        yield app


def test_greedy_choices_equal_the_single_answer_and_usage_counts_each(app):
    one = post(app, "/v1/completions", {**BODY, "temperature": 0}).json()
    three = post(app, "/v1/completions", {**BODY, "temperature": 0, "n": 3}).json()
    assert [c["index"] for c in three["choices"]] == [0, 1, 2]
    assert {c["text"] for c in three["choices"]} == {one["choices"][0]["text"]}
    assert three["usage"]["prompt_tokens"] == one["usage"]["prompt_tokens"]
    assert three["usage"]["completion_tokens"] == 3 * one["usage"]["completion_tokens"] == 24


def test_seeded_choice_i_equals_a_single_request_with_seed_plus_i(app):
    body = {**BODY, "temperature": 1.0, "seed": 41}
    texts = [c["text"] for c in post(app, "/v1/completions",
                                      {**body, "n": 3}).json()["choices"]]
    singles = [post(app, "/v1/completions", {**body, "seed": 41 + i}).json()["choices"][0]["text"] for i in range(3)]
    assert texts == singles
    assert len(set(texts)) > 1  # the choices are samples of their own


def test_a_chat_stream_carries_every_choice_by_index_and_the_usage_of_all(app):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 6, "ignore_eos": True,
            "temperature": 1.0, "seed": 5, "n": 2}
    full = post(app, "/v1/chat/completions", body).json()
    r = post(app, "/v1/chat/completions", {**body, "stream": True, "stream_options": {"include_usage": True}})
    events = [e[len("data: "):] for e in r.text.split("\n\n") if e]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    usage = chunks.pop()
    assert usage["choices"] == []
    # the same counts; the streamed request found the first one's prompt in the prefix cache
    cached = usage["usage"].pop("prompt_tokens_details")["cached_tokens"]
    assert full["usage"].pop("prompt_tokens_details") == {"cached_tokens": 0}
    assert usage["usage"] == full["usage"] and cached == (full["usage"]["prompt_tokens"] - 1) // 16 * 16 > 0
    texts, finishes, roles = ["", ""], [0, 0], [0, 0]
    for chunk in chunks:
        [choice] = chunk["choices"]
        delta = choice["delta"]
        roles[choice["index"]] += delta.get("role") == "assistant"
        texts[choice["index"]] += delta.get("content") or ""
        finishes[choice["index"]] += choice["finish_reason"] is not None
    assert roles == [1, 1] and finishes == [1, 1]
    assert texts == [c["message"]["content"] for c in full["choices"]]
