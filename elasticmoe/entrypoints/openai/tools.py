"""Tool calls of the chat API, made by structured outputs.

A request's `tools` are passed to the chat template (a model's template renders them); what the
model answers is constrained by `tool_choice`:
- a named function (`{"type": "function", "function": {"name": "f"}}`): the answer is the
  function's arguments, a JSON object matching its `parameters` schema; it comes back as one call
  of f (finish_reason "stop", as OpenAI answers a forced call);
- `"required"`: the answer is a JSON array of `{"name": ..., "parameters": {...}}`, each item one
  of the tools with its own schema (one item at most with `parallel_tool_calls: false`); it comes
  back as those calls (finish_reason "tool_calls"). vLLM builds the same array;
- `"none"`: a text answer (the tools may still be in the prompt).
`"auto"` (the default when tools are given): the model chooses between text and calls in its own
format, which needs a parser of that format (vLLM's `--tool-call-parser`). Here the format is read
from the chat template: one that shows Hermes' `<tool_call>` tag (Qwen2.5, Qwen3, Hermes) gets
Hermes parsing (`hermes`); for any other model "auto" with tools is refused by name rather than
answered as text that may hold an unparsed call. With `parallel_tool_calls: false` an "auto" answer
keeps the model's first call only (whole and streamed, as vLLM filters them).
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from elasticmoe.entrypoints.openai import hermes
from elasticmoe.entrypoints.openai.responses import (
    ChatResponseMessage,
    DeltaFunctionCall,
    DeltaToolCall,
    FunctionCall,
    ToolCall,
    random_id,
)
from elasticmoe.sampling_params import SamplingParamError
from elasticmoe.structured_outputs import MAX_SPEC_CHARS, StructuredOutputs

MAX_TOOLS = 128
MAX_DESCRIPTION_CHARS = 8192
NAME_PATTERN = r"^[a-zA-Z0-9_-]{1,64}$"  # OpenAI's rule for function names
_NO_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}

ToolMode = Literal["named", "required", "auto"]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class FunctionDefinition(_Strict):
    name: str = Field(pattern=NAME_PATTERN, description="The function's name: letters, digits, _ and -, up to 64.")
    description: str | None = Field(default=None, max_length=MAX_DESCRIPTION_CHARS)
    parameters: dict[str, Any] | None = Field(
        default=None, description="A JSON schema of the arguments' object; none: no arguments."
    )
    strict: bool | None = Field(default=None, description="Accepted; the arguments always match the schema here.")


class Tool(_Strict):
    type: Literal["function"] = Field(description="Only function tools.")
    function: FunctionDefinition


class FunctionName(_Strict):
    name: str = Field(pattern=NAME_PATTERN)


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: FunctionName


class ToolCallFunction(BaseModel):
    """A function call of an earlier assistant turn, as the client sends it back."""

    name: str = Field(max_length=64)
    arguments: str = Field(max_length=MAX_SPEC_CHARS, description="The arguments as a JSON object's text.")


class MessageToolCall(BaseModel):
    id: str = Field(max_length=256)
    type: Literal["function"] = "function"
    function: ToolCallFunction


def parameters_of(tool: Tool) -> dict[str, Any]:
    return tool.function.parameters if tool.function.parameters is not None else _NO_PARAMETERS


def tool_mode(tools: list[Tool] | None, tool_choice: str | NamedToolChoice | None) -> ToolMode | None:
    """How the answer is constrained, or None (text); `SamplingParamError` naming the field for a
    choice that cannot be served."""
    choice = tool_choice if tool_choice is not None else ("auto" if tools else "none")
    if choice == "none" or (choice == "auto" and not tools):  # no tools to call: both mean a text answer
        return None
    if not tools:
        raise SamplingParamError("tool_choice", "needs tools")
    if choice == "auto":
        return "auto"  # the served model's template decides whether it can be parsed (`check_auto`)
    if choice == "required":
        return "required"
    assert isinstance(choice, NamedToolChoice)
    if choice.function.name not in {t.function.name for t in tools}:
        raise SamplingParamError("tool_choice", f"names {choice.function.name!r}, which is not among the tools")
    return "named"


def check_auto(chat_template: str | None) -> None:
    """`SamplingParamError` naming `tool_choice` unless the model's answers can be read for calls."""
    if not hermes.uses_hermes(chat_template):
        raise SamplingParamError("tool_choice", '"auto" (the default with tools) needs a parser of the model\'s '
                                 "own tool-call format; this model's chat template shows none this server reads "
                                 '(Hermes\' <tool_call> tags): send "required", a named function ({"type": '
                                 '"function", "function": {"name": ...}}) or "none"')


def tool_constraint(tools: list[Tool], mode: ToolMode, tool_choice: Any, parallel: bool) -> StructuredOutputs:
    """The structured output that makes the answer a call (or calls) of `tools`."""
    if mode == "named":
        tool = next(t for t in tools if t.function.name == tool_choice.function.name)
        return StructuredOutputs.json_schema(parameters_of(tool), "tools")  # a bad schema is the tools' fault
    items = [{"type": "object", "additionalProperties": False, "required": ["name", "parameters"],
              "properties": {"name": {"const": t.function.name}, "parameters": parameters_of(t)}} for t in tools]
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": items}}
    if not parallel:
        schema["maxItems"] = 1
    return StructuredOutputs.json_schema(schema, "tools")


def _calls(pairs: list[tuple[str, str]]) -> list[ToolCall]:
    return [ToolCall(function=FunctionCall(name=name, arguments=arguments)) for name, arguments in pairs]


def calls_of(text: str, mode: Literal["named", "required"], name: str | None) -> list[ToolCall] | None:
    """The calls a whole constrained answer makes, or None if it is not whole (cut by max_tokens)."""
    if mode == "named":
        try:
            json.loads(text)
        except ValueError:
            return None
        return [ToolCall(function=FunctionCall(name=name or "", arguments=text))]
    try:
        items = json.loads(text)
        return [ToolCall(function=FunctionCall(name=item["name"], arguments=json.dumps(item["parameters"],
                                                                                         ensure_ascii=False)))
                for item in items]
    except (ValueError, TypeError, KeyError):  # not whole, or not the array the grammar makes (a stop string cut it)
        return None


def finish_reason(mode: ToolMode | None, reason: str | None, made_calls: bool) -> str | None:
    """OpenAI's: "tool_calls" where the model chose to call ("required", "auto"); a forced call ends "stop"."""
    return "tool_calls" if mode in ("required", "auto") and reason == "stop" and made_calls else reason


def chat_message(text: str, reason: str | None, mode: ToolMode | None, name: str | None, parallel: bool = True
                 ) -> tuple[ChatResponseMessage, str | None]:
    """A whole answer's message and finish reason: its calls, or its text where it makes none (no
    tool mode, or an answer cut short, whose text is the partial call). Not `parallel`: one call at
    most ("auto" keeps the model's first call, as vLLM does; "required" is held to one by its grammar)."""
    if mode == "auto":  # the model's own format: its calls, and the text beside them
        content, pairs = hermes.parse(text)
        pairs = pairs if parallel else pairs[:1]
        if not pairs:
            return ChatResponseMessage(content=text), reason
        return ChatResponseMessage(content=content or None, tool_calls=_calls(pairs)), finish_reason(mode, reason, True)
    calls = calls_of(text, mode, name) if mode is not None else None
    if calls is None:
        return ChatResponseMessage(content=text), reason
    return ChatResponseMessage(content=None, tool_calls=calls), finish_reason(mode, reason, True)


class ToolCallDeltas:
    """A choice's stream of tool-call deltas: a named call streams its arguments as they come (its
    id and name first); a "required" answer's calls go out whole when it ends (an array's items
    are only known to be calls once parsed); an "auto" answer's content goes out as it comes and
    each of its calls once its closing tag is generated (only the first, not `parallel`)."""

    def __init__(self, mode: ToolMode, name: str | None, parallel: bool = True) -> None:
        self.mode, self.name, self.parallel = mode, name, parallel
        self.call_id: str | None = None
        self.text = ""
        self.made_calls = False  # a call went out
        self._hermes = hermes.HermesStream() if mode == "auto" else None
        self._num_calls = 0

    def feed(self, new_text: str, finished: bool) -> tuple[list[DeltaToolCall], str | None]:
        """Deltas for the answer's next piece of text (the last if `finished`), and text to send as
        content instead (a "required" answer cut short)."""
        self.text += new_text
        if self._hermes is not None:  # "auto": content as it comes, each call once it closes
            content, pairs = self._hermes.feed(new_text, finished)
            if not self.parallel:
                pairs = pairs[: max(0, 1 - self._num_calls)]
            deltas = []
            for call in _calls(pairs):
                piece = DeltaFunctionCall(name=call.function.name, arguments=call.function.arguments)
                deltas.append(DeltaToolCall(index=self._num_calls, id=call.id, type="function", function=piece))
                self._num_calls += 1
            self.made_calls |= bool(deltas)
            return deltas, content or None
        if self.mode == "named":
            deltas = []
            if self.call_id is None:
                self.call_id = random_id("call")
                deltas.append(DeltaToolCall(index=0, id=self.call_id, type="function",
                                            function=DeltaFunctionCall(name=self.name, arguments="")))
            if new_text:
                deltas.append(DeltaToolCall(index=0, function=DeltaFunctionCall(arguments=new_text)))
            self.made_calls = True
            return deltas, None
        if not finished:
            return [], None
        calls = calls_of(self.text, "required", None)
        if calls is None:
            return [], self.text
        self.made_calls = True
        return [DeltaToolCall(index=i, id=c.id, type="function",
                              function=DeltaFunctionCall(name=c.function.name, arguments=c.function.arguments))
                for i, c in enumerate(calls)], None
