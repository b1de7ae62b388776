"""OpenAI-compatible response models (pydantic v2): what the servers answer and stream.

They mirror the shapes of the OpenAI API (`cmpl-`/`chatcmpl-` ids, `object`, `created`, `usage`);
extensions are marked as such in their description. The request models are in `protocol`.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, Field, PrivateAttr, model_serializer


def random_id(prefix: str) -> str:
    """An OpenAI-style id such as `cmpl-3f2a...` (32 hex chars after the prefix)."""
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0  # prompt tokens found in the prefix cache (OpenAI's field)


class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails | None = None

    @classmethod
    def of(cls, prompt_tokens: int, completion_tokens: int, cached_tokens: int | None = None) -> UsageInfo:
        return cls(
            prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens,
            total_tokens=prompt_tokens + completion_tokens,
            prompt_tokens_details=None if cached_tokens is None else PromptTokensDetails(cached_tokens=cached_tokens),
        )


class CompletionLogprobs(BaseModel):
    """Legacy completions logprobs: parallel lists, one entry per output token."""

    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = Field(
        default=None, description="Extension: the stop string or token id that matched."
    )


class CompletionResponse(BaseModel):
    id: str = Field(default_factory=lambda: random_id("cmpl"))
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=now)
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo
    system_fingerprint: str | None = None
    _adapter_state: str | None = PrivateAttr(None)  # the ADAPTER_STATE_HEADER's value; not in the body


class CompletionStreamChoice(BaseModel):
    index: int = 0
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None


class CompletionStreamResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionStreamChoice]
    usage: UsageInfo | None = None
    system_fingerprint: str | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatChoiceLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None = None
    refusal: list[ChatTokenLogprob] | None = None


def _with_reasoning_content(data: dict[str, Any]) -> dict[str, Any]:
    """A message (or delta) as sent: its `reasoning` also as `reasoning_content`, the name DeepSeek's
    API and earlier vLLM use; neither when there is none (no --reasoning-parser)."""
    reasoning = data.get("reasoning")
    if reasoning is None:
        data.pop("reasoning", None)
    else:
        data["reasoning_content"] = reasoning
    return data


class _OmitsNone(BaseModel):
    """A streamed delta: fields left unset (None) are not sent."""

    @model_serializer(mode="wrap")
    def _drop_none(self, handler: Any) -> dict[str, Any]:
        return self._as_sent({k: v for k, v in handler(self).items() if v is not None})

    def _as_sent(self, data: dict[str, Any]) -> dict[str, Any]:
        """The set fields as they go out (a subclass may add derived ones)."""
        return data


class FunctionCall(BaseModel):
    name: str
    arguments: str = Field(description="The function's arguments, as a JSON object's text.")


class ToolCall(BaseModel):
    id: str = Field(default_factory=lambda: random_id("call"))
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatResponseMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None = None
    refusal: str | None = None
    tool_calls: list[ToolCall] = Field(default_factory=list)
    # With --reasoning-parser: the model's thinking (vLLM's `reasoning`). Omitted without a parser.
    reasoning: str | None = None

    @model_serializer(mode="wrap")
    def _reasoning_under_both_names(self, handler: Any) -> dict[str, Any]:
        return _with_reasoning_content(handler(self))


class DeltaFunctionCall(_OmitsNone):
    """A streamed piece of a call: the name once, the arguments' text in pieces."""

    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(_OmitsNone):
    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall


class ChatCompletionChoice(BaseModel):
    index: int = 0
    message: ChatResponseMessage
    logprobs: ChatChoiceLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = Field(
        default=None, description="Extension: the stop string or token id that matched."
    )


class ChatCompletionResponse(BaseModel):
    id: str = Field(default_factory=lambda: random_id("chatcmpl"))
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=now)
    model: str
    choices: list[ChatCompletionChoice]
    usage: UsageInfo
    system_fingerprint: str | None = None
    _adapter_state: str | None = PrivateAttr(None)  # the ADAPTER_STATE_HEADER's value; not in the body


class DeltaMessage(_OmitsNone):
    """A streamed message delta; unset fields are omitted (`{}` in the final chunk)."""

    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning: str | None = None  # with --reasoning-parser: a piece of the thinking
    tool_calls: list[DeltaToolCall] | None = None

    def _as_sent(self, data: dict[str, Any]) -> dict[str, Any]:
        return _with_reasoning_content(data)


class ChatCompletionStreamChoice(BaseModel):
    index: int = 0
    delta: DeltaMessage
    logprobs: ChatChoiceLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None


class ChatCompletionStreamResponse(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatCompletionStreamChoice]
    usage: UsageInfo | None = None
    system_fingerprint: str | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=now)
    owned_by: str = "elasticmoe"
    root: str | None = Field(default=None, description="Extension: the base model this id serves.")
    parent: str | None = Field(default=None, description="Extension: for an adapter, the base model's id.")
    adapter_type: str | None = Field(default=None, description="Extension: 'esft' for an ESFT adapter.")
    max_model_len: int | None = Field(default=None, description="Extension: context length in tokens.")


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard] = Field(default_factory=list)


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: int | str | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo
