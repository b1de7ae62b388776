"""The Hermes tool-call format read from answers: whole, and streamed piece by piece (split at
every position, the same content and calls come out)."""

from __future__ import annotations

import pytest

from elasticmoe.entrypoints.openai import hermes, tools

ANSWER = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>\n'
          '<tool_call>{"name": "get_time", "arguments": "{\\"tz\\": \\"CET\\"}"}</tool_call> Done <tool_')
CALLS = [("get_weather", '{"city": "Oslo"}'), ("get_time", '{"tz": "CET"}')]


def test_a_whole_answer():
    content, calls = hermes.parse(ANSWER)
    assert calls == CALLS and content == "Let me check.\n\n Done <tool_"


@pytest.mark.parametrize("text,content", [
    ("<tool_call>not json</tool_call>", "<tool_call>not json</tool_call>"),  # not a call: kept as written
    ('<tool_call>{"arguments": {}}</tool_call>', '<tool_call>{"arguments": {}}</tool_call>'),  # no name
    ("plain <tool_call> never closed", "plain <tool_call> never closed"),
])
def test_what_is_not_a_call_stays_content(text, content):
    assert hermes.parse(text) == (content, [])


@pytest.mark.parametrize("size", [1, 2, 3, 7, 11, len(ANSWER)])
def test_a_stream_gives_the_whole_answers_content_and_calls(size):
    stream = hermes.HermesStream()
    content, calls = "", []
    pieces = [ANSWER[i : i + size] for i in range(0, len(ANSWER), size)]
    for i, piece in enumerate(pieces):
        text, closed = stream.feed(piece, finished=i == len(pieces) - 1)
        content += text
        calls += closed
        assert "<tool_call>{" not in content  # a call's text is never sent as content
    assert calls == CALLS and content.strip() == hermes.parse(ANSWER)[0].strip()


def test_a_stream_holds_back_only_what_may_be_a_tag():
    stream = hermes.HermesStream()
    assert stream.feed("Hello <to", finished=False) == ("Hello ", [])
    assert stream.feed("day", finished=False) == ("<today", [])
    assert stream.feed(" <tool_call>{", finished=False) == (" ", [])
    assert stream.feed('"x', finished=True) == ('<tool_call>{"x', [])  # never closed: content after all


def test_auto_is_served_for_templates_that_show_the_tag():
    assert tools.tool_mode([tools.Tool.model_validate({"type": "function", "function": {"name": "f"}})],
                           None) == "auto"
    tools.check_auto("... wrap each call in <tool_call></tool_call> ...")
    for template in (None, "{{ messages }}"):
        with pytest.raises(ValueError) as info:
            tools.check_auto(template)
        assert info.value.param == "tool_choice"  # type: ignore[attr-defined]
    message, reason = tools.chat_message(ANSWER, "stop", "auto", None)
    assert [(c.function.name, c.function.arguments) for c in message.tool_calls] == CALLS
    assert message.content == "Let me check.\n\n Done <tool_" and reason == "tool_calls"
    message, reason = tools.chat_message("just text", "stop", "auto", None)
    assert (message.content, message.tool_calls, reason) == ("just text", [], "stop")
