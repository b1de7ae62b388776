"""`--reasoning-parser` over HTTP with a scripted engine that thinks first (a random model never
writes the tags): the thinking comes back as `reasoning` apart from the content, whole and streamed,
with tool calls after it; a request that turns thinking off, a constrained answer and a server
without a parser leave the text as it is."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from fake_engine import FakeTokenizer
from in_process_server import post, sse_events
from test_tool_calls_auto_api import HERMES_TEMPLATE, TOOLS, ScriptedEngine

from elasticmoe.engine.async_llm import AsyncLLM
from elasticmoe.entrypoints.openai import reasoning
from elasticmoe.entrypoints.openai.api_server import build_app

MODEL = "scripted"
THOUGHT = ["<th", "ink>\nThe user", " wants Oslo's weather.\n", "</think>", "\n\n", "Checking now. ",
           '<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>']
BODY = {"model": MODEL, "messages": [{"role": "user", "content": "Weather in Oslo?"}]}


class TemplateTokenizer(FakeTokenizer):
    def __init__(self) -> None:
        self.hf = SimpleNamespace(chat_template=HERMES_TEMPLATE)
        self.kwargs_seen: list = []

    def apply_chat_template(self, messages, tools=None, template_kwargs=None):
        self.kwargs_seen.append(template_kwargs)
        return super().apply_chat_template(messages)


@pytest.fixture(params=["qwen3", None], ids=["qwen3-parser", "no-parser"])
def served(request, monkeypatch):
    monkeypatch.setattr("test_tool_calls_auto_api.ANSWER", THOUGHT)
    engine = ScriptedEngine()
    engine.tokenizer = TemplateTokenizer()
    llm = AsyncLLM(engine)
    llm.start()
    yield build_app(llm, MODEL, reasoning_parser=request.param), engine, request.param
    llm.shutdown()


def test_the_thinking_comes_back_apart_from_the_answer(served):
    app, _, parser = served
    message = post(app, "/v1/chat/completions", BODY).json()["choices"][0]["message"]
    if parser is None:
        assert message["content"] == "".join(THOUGHT) and "reasoning" not in message
        return
    assert message["reasoning"] == message["reasoning_content"] == "The user wants Oslo's weather."
    assert message["content"] == "Checking now. " + THOUGHT[-1]


def test_a_streamed_answer_sends_the_thinking_then_the_content(served):
    app, _, parser = served
    deltas = [e["choices"][0]["delta"] for e in sse_events(post(app, "/v1/chat/completions", {**BODY, "stream": True}))
              if e["choices"]]
    thinking = "".join(d.get("reasoning") or "" for d in deltas)
    content = "".join(d.get("content") or "" for d in deltas)
    if parser is None:
        assert thinking == "" and content == "".join(THOUGHT)
        return
    assert thinking == "".join(d.get("reasoning_content") or "" for d in deltas) == "The user wants Oslo's weather."
    assert content == "Checking now. " + THOUGHT[-1]
    first_content = next(i for i, d in enumerate(deltas) if d.get("content"))
    assert all(not d.get("reasoning") for d in deltas[first_content:])  # thinking first, then the answer


def test_tool_calls_are_read_from_the_answer_after_the_thinking(served):
    app, _, parser = served
    if parser is None:
        return
    body = {**BODY, "tools": TOOLS}
    choice = post(app, "/v1/chat/completions", body).json()["choices"][0]
    assert choice["message"]["reasoning"] == "The user wants Oslo's weather."
    assert choice["message"]["content"] == "Checking now."
    assert [c["function"]["name"] for c in choice["message"]["tool_calls"]] == ["get_weather"]
    events = sse_events(post(app, "/v1/chat/completions", {**body, "stream": True}))
    deltas = [e["choices"][0]["delta"] for e in events if e["choices"]]
    assert "".join(d.get("reasoning") or "" for d in deltas) == "The user wants Oslo's weather."
    assert [c["function"]["name"] for d in deltas for c in d.get("tool_calls", [])] == ["get_weather"]


def test_a_request_that_turns_thinking_off_gets_its_text_as_content(served):
    app, engine, parser = served
    body = {**BODY, "chat_template_kwargs": {"enable_thinking": False}}
    message = post(app, "/v1/chat/completions", body).json()["choices"][0]["message"]
    assert engine.tokenizer.kwargs_seen[-1] == {"enable_thinking": False}  # the template was given it
    assert message["content"] == "".join(THOUGHT) and "reasoning" not in message


def test_chat_template_kwargs_may_not_set_the_servers_own_arguments(served):
    app, _, _ = served
    for key in ("add_generation_prompt", "tools", "chat_template"):
        r = post(app, "/v1/chat/completions", {**BODY, "chat_template_kwargs": {key: "x"}})
        assert r.status_code == 400 and r.json()["error"]["param"] == "chat_template_kwargs", r.text
        assert repr(key) in r.json()["error"]["message"]
    r = post(app, "/v1/chat/completions", {**BODY, "chat_template_kwargs": ["enable_thinking"]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "chat_template_kwargs"


def test_an_unknown_parser_is_refused_at_start():
    with pytest.raises(ValueError, match="reasoning_parser"):
        build_app(AsyncLLM(ScriptedEngine()), MODEL, reasoning_parser="o1")
    assert reasoning.PARSERS == ("qwen3", "deepseek_r1")
