"""Tool calls from constrained answers (`entrypoints/openai/tools.py`): which constraint each
`tool_choice` makes, how a whole answer becomes calls, and how a stream's deltas carry them."""

from __future__ import annotations

import json

import pytest

from elasticmoe.entrypoints.openai import tools
from elasticmoe.errors import InvalidRequestError

F = tools.Tool.model_validate({"type": "function", "function": {"name": "f", "parameters": {
    "type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}}})
G = tools.Tool.model_validate({"type": "function", "function": {"name": "g"}})  # no parameters: an empty object
NAMED_F = tools.NamedToolChoice.model_validate({"type": "function", "function": {"name": "f"}})


def _out(new_text: str, finished: bool = False, reason: str | None = None) -> tuple[str, bool]:
    """An answer's next piece as `ToolCallDeltas.feed` takes it (`reason` only says how it ended)."""
    return new_text, finished


@pytest.mark.parametrize("tool_list,choice,mode", [
    (None, None, None), ([], "auto", None), ([F], "none", None), ([F], "required", "required"), ([F, G], NAMED_F, "named"),
    ([F], None, "auto"), ([F], "auto", "auto"),  # served where the model's template shows a format read here
])
def test_the_mode_each_choice_asks_for(tool_list, choice, mode):
    assert tools.tool_mode(tool_list, choice) == mode


@pytest.mark.parametrize("tool_list,choice,says", [
    (None, "required", "needs tools"),
    ([G], NAMED_F, "not among the tools"),
])
def test_choices_that_cannot_be_served(tool_list, choice, says):
    with pytest.raises(InvalidRequestError) as info:
        tools.tool_mode(tool_list, choice)
    assert info.value.param == "tool_choice" and says in info.value.message


def test_the_constraints():
    named = tools.tool_constraint([F, G], "named", NAMED_F, True)
    assert named.kind == "json" and json.loads(named.spec) == F.function.parameters
    required = json.loads(tools.tool_constraint([F, G], "required", "required", True).spec)
    assert required["type"] == "array" and required["minItems"] == 1 and "maxItems" not in required
    names = [item["properties"]["name"]["const"] for item in required["items"]["anyOf"]]
    assert names == ["f", "g"] and required["items"]["anyOf"][1]["properties"]["parameters"]["type"] == "object"
    assert json.loads(tools.tool_constraint([F], "required", "required", False).spec)["maxItems"] == 1


def test_whole_answers_become_calls_and_cut_ones_stay_text():
    message, reason = tools.chat_message('{"x":1}', "stop", "named", "f")
    assert message.content is None and reason == "stop"
    assert [(c.function.name, c.function.arguments) for c in message.tool_calls] == [("f", '{"x":1}')]
    message, reason = tools.chat_message('[{"name":"f","parameters":{"x":2}},{"name":"g","parameters":{}}]', "stop",
                                         "required", None)
    assert reason == "tool_calls"
    assert [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls] == [("f", {"x": 2}),
                                                                                                ("g", {})]
    assert len({c.id for c in message.tool_calls}) == 2
    message, reason = tools.chat_message('[{"name":"f","par', "length", "required", None)
    assert (message.content, message.tool_calls, reason) == ('[{"name":"f","par', [], "length")
    message, reason = tools.chat_message("plain", "stop", None, None)
    assert (message.content, message.tool_calls, reason) == ("plain", [], "stop")


def test_a_named_call_streams_its_arguments_after_its_id_and_name():
    stream = tools.ToolCallDeltas("named", "f")
    first, text = stream.feed(*_out('{"x"'))
    assert text is None and first[0].id and first[0].function.name == "f" and first[0].function.arguments == ""
    assert first[1].function.arguments == '{"x"' and first[1].id is None
    rest, _ = stream.feed(*_out(":1}", finished=True, reason="stop"))
    assert [d.function.arguments for d in rest] == [":1}"] and stream.made_calls


def test_required_calls_go_out_whole_at_the_end_or_as_text_when_cut():
    stream = tools.ToolCallDeltas("required", None)
    assert stream.feed(*_out('[{"name":"g",')) == ([], None)
    deltas, text = stream.feed(*_out('"parameters":{}}]', finished=True, reason="stop"))
    assert text is None and [(d.index, d.function.name, d.function.arguments) for d in deltas] == [(0, "g", "{}")]
    cut = tools.ToolCallDeltas("required", None)
    cut.feed(*_out('[{"name"'))
    assert cut.feed(*_out(':"g"', finished=True, reason="length")) == ([], '[{"name":"g"')
    assert not cut.made_calls and tools.finish_reason("required", "length", False) == "length"
