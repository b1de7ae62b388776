"""`tool_choice` "auto" over HTTP with a scripted engine whose answer holds Hermes calls (a random
model never writes one): the calls come back parsed with the text beside them, whole and streamed,
for a model whose chat template shows the tag; a model whose template does not is refused."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
from fake_engine import FakeEngine, FakeTokenizer
from in_process_server import post, sse_events

from elasticmoe.engine.async_llm import AsyncLLM
from elasticmoe.entrypoints.openai.api_server import build_app
from elasticmoe.outputs import RequestOutput

MODEL = "scripted"
ANSWER = ['Checking', ' now.', ' <tool', '_call>{"name": "get_weather", ', '"arguments": {"city": "Oslo"}}</tool_call>',
          '<tool_call>{"name": "get_time", "arguments": {}}', "</tool_call>"]
TOOLS = [{"type": "function", "function": {"name": n}} for n in ("get_weather", "get_time")]
BODY = {"model": MODEL, "messages": [{"role": "user", "content": "Weather in Oslo?"}], "tools": TOOLS}
HERMES_TEMPLATE = "{% for m in messages %}{{ m.content }}{% endfor %} Call tools as <tool_call>{...}</tool_call>."


class HermesTokenizer(FakeTokenizer):
    def __init__(self, template: str) -> None:
        self.hf = SimpleNamespace(chat_template=template)
        self.tools_seen: list = []

    def apply_chat_template(self, messages: list[dict], tools: list[dict] | None = None,
                            template_kwargs: dict | None = None) -> list[int]:
        self.tools_seen.append(tools)
        return super().apply_chat_template(messages)


class ScriptedEngine(FakeEngine):
    """Each step emits the next piece of `ANSWER`; the last one finishes with "stop"."""

    def step(self) -> list[RequestOutput]:
        outputs = []
        for rid, req in list(self.requests.items()):
            i = len(req.output_ids)
            req.output_ids.append(100 + i)
            req.text += ANSWER[i]
            finished = i == len(ANSWER) - 1
            outputs.append(RequestOutput(rid, list(req.prompt_ids), [100 + i], ANSWER[i], list(req.output_ids), req.text,
                                         finished=finished, finish_reason="stop" if finished else None))
            if finished:
                del self.requests[rid]
        return outputs


@pytest.fixture(params=[HERMES_TEMPLATE, "{% for m in messages %}{{ m.content }}{% endfor %}"], ids=["hermes", "other"])
def served(request):
    engine = ScriptedEngine()
    engine.tokenizer = HermesTokenizer(request.param)
    llm = AsyncLLM(engine)
    llm.start()
    yield build_app(llm, MODEL), engine, request.param == HERMES_TEMPLATE
    llm.shutdown()


def test_auto_answers_parsed_calls_beside_the_text(served):
    app, engine, hermes = served
    response = post(app, "/v1/chat/completions", BODY)
    if not hermes:
        assert response.status_code == 400 and response.json()["error"]["param"] == "tool_choice"
        assert "<tool_call>" in response.json()["error"]["message"]
        return
    choice = response.json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"]["content"] == "Checking now."
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in choice["message"]["tool_calls"]] \
        == [("get_weather", {"city": "Oslo"}), ("get_time", {})]
    assert engine.tokenizer.tools_seen[-1] == TOOLS  # the template was given the tools


def test_an_auto_stream_sends_the_text_then_each_call_as_it_closes(served):
    app, _, hermes = served
    if not hermes:
        return
    response = post(app, "/v1/chat/completions", {**BODY, "stream": True})
    events = sse_events(response)
    deltas = [e["choices"][0]["delta"] for e in events if e["choices"]]
    content = "".join(d.get("content") or "" for d in deltas)
    calls = [c for d in deltas for c in d.get("tool_calls", [])]
    assert content == "Checking now. "
    assert [(c["index"], c["function"]["name"]) for c in calls] == [(0, "get_weather"), (1, "get_time")]
    assert all(c["id"] and c["type"] == "function" for c in calls)
    assert events[-1]["choices"][0]["finish_reason"] == "tool_calls"


def test_without_parallel_calls_auto_keeps_the_first_call_whole_and_streamed(served):
    app, _, hermes = served
    if not hermes:
        return
    body = {**BODY, "parallel_tool_calls": False}
    choice = post(app, "/v1/chat/completions", body).json()["choices"][0]
    assert [c["function"]["name"] for c in choice["message"]["tool_calls"]] == ["get_weather"]
    assert choice["message"]["content"] == "Checking now." and choice["finish_reason"] == "tool_calls"
    deltas = [e["choices"][0]["delta"] for e in sse_events(post(app, "/v1/chat/completions", {**body, "stream": True}))
              if e["choices"]]
    assert [(c["index"], c["function"]["name"]) for d in deltas for c in d.get("tool_calls", [])] == [(0, "get_weather")]
