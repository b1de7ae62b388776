"""OpenAI-compatible request models (pydantic v2); the responses are in `responses`.

Requests validate everything they can on their own: an invalid field fails
validation with the field's name in the error location, which the error
handlers turn into a 400 whose `param` is that field. Cross-field checks raise
`SamplingParamError` so they, too, name the field. `to_sampling_params()` is the
only place an HTTP request becomes engine `SamplingParams`.
"""

from __future__ import annotations

import dataclasses
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from elasticmoe.entrypoints.openai import not_implemented, structured
from elasticmoe.entrypoints.openai import tools as tooling  # not `tools`: a request field has that name
from elasticmoe.sampling_params import (
    MAX_ALLOWED_TOKEN_IDS,
    MAX_BAD_WORD_CHARS,
    MAX_BAD_WORDS,
    MAX_INT32,
    MAX_LOGIT_BIAS,
    MAX_LOGIT_BIAS_TOKENS,
    MAX_LOGPROBS,
    MAX_PENALTY,
    MAX_REPETITION_PENALTY,
    MAX_STOP_CHARS,
    MAX_STOP_TOKEN_IDS,
    SEED_MAX,
    SEED_MIN,
    SamplingParamError,
    SamplingParams,
)
from elasticmoe.structured_outputs import MAX_CHOICES as MAX_STRUCTURED_CHOICES
from elasticmoe.structured_outputs import MAX_SPEC_CHARS

# Bounds of the HTTP schema (the OpenAPI document states them, so a fuzzer knows where they are).
MAX_NAME_CHARS = 256  # model, user, message names
MAX_PROMPT_TOKEN_IDS = 1 << 20  # the engine then checks the model's context length
MAX_MESSAGES = 4096
MAX_CONTENT_PARTS = 256
MAX_CHOICES = 16  # `n`: each choice is an engine request of its own, so n multiplies a request's cost


def first_unencodable_field(body: Any) -> str | None:
    """The top-level field of `body` holding a string that is not valid Unicode (a lone surrogate,
    which JSON's `\\ud800` escape can carry), or None. Iterative: nesting depth costs no stack."""
    if not isinstance(body, dict):
        return None
    for key, value in body.items():
        stack = [key, value]
        while stack:
            item = stack.pop()
            if isinstance(item, str):
                try:
                    item.encode("utf-8")
                except UnicodeEncodeError:
                    return str(key) if isinstance(key, str) else None
            elif isinstance(item, dict):
                stack.extend(item.keys())
                stack.extend(item.values())
            elif isinstance(item, list):
                stack.extend(item)
    return None


# apply_chat_template's own arguments: a request's chat_template_kwargs are the template's variables only.
TEMPLATE_ARGUMENTS = frozenset({
    "messages", "conversation", "tools", "documents", "chat_template", "add_generation_prompt",
    "continue_final_message", "tokenize", "padding", "truncation", "max_length", "return_tensors", "return_dict",
    "return_assistant_tokens_mask", "tokenizer_kwargs",
})


class _Request(BaseModel):
    # Unknown fields are ignored (as vLLM does) so that SDKs sending newer options keep working;
    # known ones this server does not implement are refused (`not_implemented`).
    model_config = ConfigDict(extra="ignore")

    @model_validator(mode="before")
    @classmethod
    def _strings_are_unicode(cls, data: Any) -> Any:
        field = first_unencodable_field(data)
        if field is not None:
            raise SamplingParamError(field, "must be valid Unicode text (it holds a lone surrogate)")
        return data


class StreamOptions(BaseModel):
    include_usage: bool = Field(
        default=False, strict=True, description="Send one extra chunk before [DONE] with `usage` and empty `choices`."
    )


class _SamplingFields(_Request):
    """Fields shared by completions and chat completions."""

    model: str = Field(max_length=MAX_NAME_CHARS, description="Name of the served model (see GET /v1/models).")
    temperature: float = Field(default=1.0, ge=0.0, le=2.0, description="Sampling temperature; 0 is greedy.")
    top_p: float = Field(default=1.0, gt=0.0, le=1.0, description="Nucleus sampling probability mass.")
    top_k: int = Field(
        default=-1, ge=-1, le=MAX_INT32,
        description="Extension: sample from the k most likely tokens; -1 or 0 disables.",
    )
    seed: int | None = Field(
        default=None, ge=SEED_MIN, le=SEED_MAX,
        description="Seed for reproducible sampling of this request (64 bits, signed or unsigned).",
    )
    stop: str | list[str] | None = Field(
        default=None,
        description=f"Up to 4 strings of 1 to {MAX_STOP_CHARS} characters; generation stops before any of "
        "them (excluded from the output).",
    )
    stop_token_ids: list[Annotated[int, Field(ge=0, le=MAX_INT32)]] | None = Field(
        default=None, max_length=MAX_STOP_TOKEN_IDS, description="Extension: token ids that end generation."
    )
    n: int = Field(default=1, ge=1, le=MAX_CHOICES, description=f"Number of choices, 1 to {MAX_CHOICES}: each is "
                   "sampled on its own (with a seed, choice i uses seed + i).")
    stream: bool = Field(default=False, strict=True, description="Stream partial results as server-sent events.")
    stream_options: StreamOptions | None = Field(
        default=None, description="Streaming options; only with stream=true."
    )
    ignore_eos: bool = Field(
        default=False, strict=True, description="Extension: keep generating past end-of-sequence tokens."
    )
    lora_routing: dict | None = Field(
        default=None,
        description='Extension: per-token LoRA routing by vocabulary range, {"type": "vocab", "breaks": '
        '[token ids], "adapters": [LoRA adapter names or null, one per range]} (MoLoRA); with the base '
        "model as `model`.",
    )
    user: str | None = Field(
        default=None, max_length=MAX_NAME_CHARS, description="End-user identifier (accepted, not used)."
    )
    presence_penalty: float = Field(
        default=0.0, ge=-MAX_PENALTY, le=MAX_PENALTY,
        description="Subtracted once from the logit of every token the output holds so far.",
    )
    frequency_penalty: float = Field(
        default=0.0, ge=-MAX_PENALTY, le=MAX_PENALTY,
        description="Subtracted from a token's logit once per time the output holds it so far.",
    )
    repetition_penalty: float = Field(
        default=1.0, gt=0.0, le=MAX_REPETITION_PENALTY,
        description="Extension (vLLM, transformers): every token of the prompt and the output so far has a "
        "positive logit divided by this, a negative one multiplied; 1 is off.",
    )
    min_tokens: int = Field(
        default=0, ge=0, le=MAX_INT32,
        description="Extension (vLLM): no end-of-sequence token, stop token or stop string ends the answer "
        "before this many tokens.",
    )
    min_p: float = Field(
        default=0.0, ge=0.0, le=1.0,
        description="Extension (vLLM): a sampled token needs at least this times the most likely token's "
        "probability; 0 is off.",
    )
    allowed_token_ids: list[Annotated[int, Field(ge=0, le=MAX_INT32)]] | None = Field(
        default=None, min_length=1, max_length=MAX_ALLOWED_TOKEN_IDS,
        description="Extension (vLLM): only these token ids may be generated.",
    )
    bad_words: list[Annotated[str, Field(min_length=1, max_length=MAX_BAD_WORD_CHARS)]] | None = Field(
        default=None, max_length=MAX_BAD_WORDS,
        description="Extension (vLLM): words the answer must not contain (each tokenized as it starts a text and "
        "after a space).",
    )
    include_stop_str_in_output: bool = Field(
        default=False, strict=True, description="Extension (vLLM): keep the stop string that ended the answer in it."
    )
    cache_salt: str | None = Field(
        default=None, description="Extension (vLLM): the request shares prefix-cache blocks only with requests "
        "of the same salt. A tenant's secret (random, e.g. 43 base64 characters): other tenants cannot learn its "
        "prompts from how fast theirs start. 1 to 128 characters without '@', '/', '\\' or NUL.",
    )
    response_format: dict[str, Any] | None = Field(
        default=None,
        description='{"type": "text"} (the default), {"type": "json_object"} (the answer is a JSON object) or '
        '{"type": "json_schema", "json_schema": {"name": ..., "schema": {...}}} (it matches the schema).',
    )
    structured_outputs: dict[str, Any] | None = Field(
        default=None,
        description='Extension (vLLM): the answer matches {"json": schema}, {"regex": ...}, {"choice": [strings]}, '
        '{"grammar": a Lark or GBNF grammar} or {"json_object": true}.',
    )
    guided_json: dict[str, Any] | str | None = Field(
        default=None, description="Extension (vLLM, older): the answer matches this JSON schema."
    )
    guided_regex: str | None = Field(
        default=None, max_length=MAX_SPEC_CHARS,
        description="Extension (vLLM, older): the answer matches this regular expression.",
    )
    guided_choice: list[str] | None = Field(
        default=None, max_length=MAX_STRUCTURED_CHOICES,
        description="Extension (vLLM, older): the answer is one of these strings.",
    )
    guided_grammar: str | None = Field(
        default=None, max_length=MAX_SPEC_CHARS,
        description="Extension (vLLM, older): the answer matches this grammar (Lark or GBNF).",
    )
    logit_bias: dict[str, float] | None = Field(
        default=None, max_length=MAX_LOGIT_BIAS_TOKENS,
        description=f"Token id (as a string) -> a bias in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}] added to its "
        "logit before sampling.",
    )

    @model_validator(mode="before")
    @classmethod
    def _refuse_unimplemented(cls, data: Any) -> Any:
        not_implemented.refuse(data, not_implemented.SHARED)
        return data

    @field_validator("stop")
    @classmethod
    def _at_most_four_stops(cls, v: str | list[str] | None) -> str | list[str] | None:
        if isinstance(v, list) and len(v) > 4:
            raise SamplingParamError("stop", f"at most 4 stop sequences are allowed, got {len(v)}")
        for s in [v] if isinstance(v, str) else v or []:
            if not 1 <= len(s) <= MAX_STOP_CHARS:
                raise SamplingParamError("stop", f"each stop sequence must have 1 to {MAX_STOP_CHARS} characters")
        return v

    @model_validator(mode="after")
    def _stream_options_need_stream(self) -> _SamplingFields:
        if self.stream_options is not None and not self.stream:
            raise SamplingParamError("stream_options", "is only allowed when stream is true")
        return self

    def _structure_fields(self) -> dict[str, Any]:
        """The fields that may ask for a structured output, as sent (`structured`)."""
        return {"response_format": self.response_format, "structured_outputs": self.structured_outputs,
                "guided_json": self.guided_json, "guided_regex": self.guided_regex,
                "guided_choice": self.guided_choice, "guided_grammar": self.guided_grammar}

    @property
    def asks_for_structure(self) -> bool:
        """A structured output is asked for (its grammar is then checked when the params are built)."""
        return structured.asks_for(self._structure_fields())

    @property
    def include_usage_chunk(self) -> bool:
        return self.stream and self.stream_options is not None and self.stream_options.include_usage

    def _sampling_params(self, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
        """Raises `SamplingParamError` (a `ValueError` with `.param`) on values the engine rejects."""
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            seed=self.seed,
            stop=[self.stop] if isinstance(self.stop, str) else list(self.stop or []),
            stop_token_ids=list(self.stop_token_ids or []),
            ignore_eos=self.ignore_eos,
            logprobs=logprobs,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            logit_bias=_token_biases(self.logit_bias),
            repetition_penalty=self.repetition_penalty,
            min_tokens=self.min_tokens,
            min_p=self.min_p,
            allowed_token_ids=self.allowed_token_ids,
            include_stop_str_in_output=self.include_stop_str_in_output,
            structured_outputs=structured.structured_outputs(self._structure_fields()),
            cache_salt=self.cache_salt,
        )


def _token_biases(logit_bias: dict[str, float] | None) -> dict[int, float]:
    """OpenAI's `logit_bias` (JSON keys are strings) with its keys as token ids."""
    biases = {}
    for key, bias in (logit_bias or {}).items():
        if not (key.isascii() and key.isdigit() and len(key) <= 10):
            raise SamplingParamError("logit_bias", f"keys must be token ids (decimal integers), got {key[:20]!r}")
        biases[int(key)] = bias
    return biases


class CompletionRequest(_SamplingFields):
    """POST /v1/completions. One prompt per request."""

    prompt: str | list[str] | list[Annotated[int, Field(ge=0, le=MAX_INT32)]] = Field(
        max_length=MAX_PROMPT_TOKEN_IDS,
        description="The prompt: a string, a list holding exactly one string, a list of token ids, or a list "
        "holding exactly one list of token ids.",
    )
    max_tokens: int | None = Field(
        default=16, ge=1, le=MAX_INT32, description="Maximum number of tokens to generate."
    )
    logprobs: int | None = Field(
        default=None,
        ge=0,
        le=MAX_LOGPROBS,
        description="Return log-probabilities of this many top tokens per position.",
    )
    echo: bool = Field(
        default=False, strict=True, description="Put the prompt (its text, or its token ids decoded) before the "
        "completion's text; not with logprobs (the prompt's are not computed)."
    )

    @model_validator(mode="before")
    @classmethod
    def _refuse_unimplemented_here(cls, data: Any) -> Any:
        not_implemented.refuse(data, not_implemented.COMPLETIONS)
        return data

    @field_validator("prompt", mode="before")
    @classmethod
    def _token_ids_in_range(cls, v: Any) -> Any:
        # Before the union's own checks, whose first error would be "should be a valid string".
        if isinstance(v, list) and v and all(isinstance(p, list) for p in v):  # a batch of token-id prompts
            if len(v) != 1:
                raise SamplingParamError("prompt", f"only one prompt per request is supported, got {len(v)}")
            v = v[0]  # OpenAI's form of one token-id prompt as a batch of one
        if isinstance(v, list) and v and all(isinstance(t, int) and not isinstance(t, bool) for t in v):
            if not all(0 <= t <= MAX_INT32 for t in v):
                raise SamplingParamError("prompt", f"token ids must be integers in [0, {MAX_INT32}]")
        return v

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, v: str | list[str] | list[int]) -> str | list[str] | list[int]:
        if isinstance(v, list):
            if not v:
                raise SamplingParamError("prompt", "must not be empty")
            if isinstance(v[0], str) and len(v) != 1:
                raise SamplingParamError("prompt", f"only one prompt per request is supported, got {len(v)}")
        return v

    @model_validator(mode="after")
    def _echo_without_logprobs(self) -> CompletionRequest:
        if self.echo and self.logprobs is not None:
            raise SamplingParamError("echo", "echo with logprobs needs the prompt's logprobs, which this server does "
                                     "not compute: send one or the other")
        return self

    @property
    def engine_prompt(self) -> str | list[int]:
        """The prompt in the form `LLMEngine.add_request` takes."""
        if isinstance(self.prompt, list) and isinstance(self.prompt[0], str):
            return self.prompt[0]
        return self.prompt  # type: ignore[return-value]

    def to_sampling_params(self) -> SamplingParams:
        return self._sampling_params(self.max_tokens, self.logprobs)


class TextContentPart(_Request):
    type: Literal["text"] = Field(description="Only text parts are supported.")
    text: str = Field(description="The text of this part.")


class ChatMessage(_Request):
    role: Literal["system", "developer", "user", "assistant", "tool"] = Field(
        description="Author of the message."
    )
    content: str | list[TextContentPart] | None = Field(
        default=None, description="A string, or a list of {'type': 'text', 'text': ...} parts."
    )
    name: str | None = Field(
        default=None, max_length=MAX_NAME_CHARS, description="Optional participant name (not used by the template)."
    )
    tool_calls: list[tooling.MessageToolCall] | None = Field(
        default=None, max_length=tooling.MAX_TOOLS, description="An assistant turn's calls, as the API returned them."
    )
    tool_call_id: str | None = Field(
        default=None, max_length=MAX_NAME_CHARS, description="A tool turn's answer to this call."
    )

    @field_validator("content", mode="before")
    @classmethod
    def _text_parts_only(cls, v: Any) -> Any:
        # Before the union's own checks, whose first error would be "should be a valid string".
        if isinstance(v, list):
            for part in v:
                kind = part.get("type") if isinstance(part, dict) else None
                if isinstance(kind, str) and kind != "text":
                    raise SamplingParamError("messages", f"only text content parts are supported, got a part of "
                                             f"type {kind[:40]!r}")
        return v

    @field_validator("content")
    @classmethod
    def _bounded_parts(cls, v: str | list[TextContentPart] | None) -> str | list[TextContentPart] | None:
        if isinstance(v, list) and len(v) > MAX_CONTENT_PARTS:
            raise SamplingParamError("messages", f"a message has at most {MAX_CONTENT_PARTS} content parts")
        return v

    @property
    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "\n".join(part.text for part in self.content)


class ChatCompletionRequest(_SamplingFields):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage] = Field(
        min_length=1, max_length=MAX_MESSAGES, description="The conversation so far."
    )
    max_tokens: int | None = Field(
        default=None, ge=1, le=MAX_INT32, description="Deprecated alias of max_completion_tokens."
    )
    max_completion_tokens: int | None = Field(
        default=None,
        ge=1,
        le=MAX_INT32,
        description="Maximum number of tokens to generate; default: up to the context length.",
    )
    logprobs: bool = Field(default=False, strict=True, description="Return log-probabilities of the output tokens.")
    top_logprobs: int | None = Field(
        default=None,
        ge=0,
        le=MAX_LOGPROBS,
        description="Number of most likely alternatives per position (needs logprobs).",
    )
    tools: list[tooling.Tool] | None = Field(
        default=None, max_length=tooling.MAX_TOOLS, description="Functions the model may call (the chat template "
        "shows them to the model where it renders tools)."
    )
    tool_choice: Literal["none", "auto", "required"] | tooling.NamedToolChoice | None = Field(
        default=None,
        description='"required" (the answer is one or more calls of the tools), {"type": "function", "function": '
        '{"name": ...}} (a call of that function), "none" (text) or "auto" (the default with tools: text or '
        "calls in the model's own format; served for models whose chat template shows Hermes' <tool_call> tags).",
    )
    parallel_tool_calls: bool = Field(
        default=True, strict=True, description='false: one call at most ("auto" keeps the first the model makes).'
    )
    chat_template_kwargs: dict[str, Any] | None = Field(
        default=None, description='More variables for the model\'s chat template, e.g. {"enable_thinking": false} '
        "for Qwen3 (which also tells --reasoning-parser qwen3 that the answer has no thinking)."
    )

    @field_validator("chat_template_kwargs")
    @classmethod
    def _template_kwargs_are_variables(cls, v: dict[str, Any] | None) -> dict[str, Any] | None:
        taken = sorted(set(v or {}) & TEMPLATE_ARGUMENTS)
        if taken:
            raise SamplingParamError("chat_template_kwargs", f"{taken[0]!r} is set by the server, not by a request")
        return v

    @model_validator(mode="before")
    @classmethod
    def _refuse_unimplemented_here(cls, data: Any) -> Any:
        not_implemented.refuse(data, not_implemented.CHAT)
        return data

    @model_validator(mode="after")
    def _top_logprobs_need_logprobs(self) -> ChatCompletionRequest:
        if self.top_logprobs and not self.logprobs:
            raise SamplingParamError("top_logprobs", "requires logprobs=true")
        return self

    @model_validator(mode="after")
    def _tools_can_be_served(self) -> ChatCompletionRequest:
        if self.tool_mode is not None and self.asks_for_structure:  # tool_mode raises for a choice not served
            raise SamplingParamError("tool_choice", "a tool call is a structured output already: it cannot "
                                     "be combined with response_format, structured_outputs or guided_*")
        return self

    @property
    def tool_mode(self) -> tooling.ToolMode | None:
        return tooling.tool_mode(self.tools, self.tool_choice)

    @property
    def tool_name(self) -> str | None:
        """The function a named `tool_choice` calls."""
        return self.tool_choice.function.name if isinstance(self.tool_choice, tooling.NamedToolChoice) else None

    def template_messages(self) -> list[dict[str, Any]]:
        """Messages as the chat template takes them: text content (and earlier turns' tool calls)."""
        messages: list[dict[str, Any]] = []
        for m in self.messages:
            message: dict[str, Any] = {"role": m.role, "content": m.text}
            if m.tool_calls:
                message["tool_calls"] = [c.model_dump() for c in m.tool_calls]
            if m.tool_call_id is not None:
                message["tool_call_id"] = m.tool_call_id
            messages.append(message)
        return messages

    def template_tools(self) -> list[dict[str, Any]] | None:
        """The tools as chat templates take them (OpenAI's form); None without tools."""
        return [t.model_dump(exclude_none=True) for t in self.tools] if self.tools else None

    def to_sampling_params(self) -> SamplingParams:
        max_tokens = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        params = self._sampling_params(max_tokens, logprobs)
        mode = self.tool_mode
        if mode is None or mode == "auto":  # "auto": the model writes text or calls in its own format
            return params
        assert self.tools is not None
        constraint = tooling.tool_constraint(self.tools, mode, self.tool_choice, self.parallel_tool_calls)
        return dataclasses.replace(params, structured_outputs=constraint)
