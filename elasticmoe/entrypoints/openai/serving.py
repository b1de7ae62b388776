"""OpenAI request handlers over an engine client, independent of the web framework.

`OpenAIServing` turns validated protocol requests into `generate()` calls and
returns either a response model or an `SSEStream` of `data: ...` events. It
needs only an object with `generate(prompt, params, request_id)` (an async
iterator of `RequestOutput`), `tokenizer` and `max_model_len`: `AsyncLLM` here,
a router over instances in the coordinator later.

Invariants:
- Input errors surface before a response starts: the first engine output is
  awaited before a stream is returned, so a rejected request is a 400, not a
  broken stream.
- Closing (or cancelling) an `SSEStream` closes the engine stream, which aborts
  the request in the engine.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator, Sequence
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any, Protocol

from pydantic import BaseModel

from elasticmoe.engine.engine_request import AdapterRef, EngineRequest
from elasticmoe.entrypoints.openai import reasoning, tools
from elasticmoe.entrypoints.openai.choices import (
    Started,
    all_or_none,
    choices_adapter_state,
    merged,
    start_choices,
)
from elasticmoe.entrypoints.openai.errors import OpenAIError, internal_error, model_not_found, to_openai_error
from elasticmoe.entrypoints.openai.prompts import PromptRenderer
from elasticmoe.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest
from elasticmoe.entrypoints.openai.responses import (
    ChatChoiceLogprobs,
    ChatCompletionChoice,
    ChatCompletionResponse,
    ChatCompletionStreamChoice,
    ChatCompletionStreamResponse,
    ChatTokenLogprob,
    CompletionChoice,
    CompletionLogprobs,
    CompletionResponse,
    CompletionStreamChoice,
    CompletionStreamResponse,
    DeltaMessage,
    ModelCard,
    ModelList,
    TopLogprob,
    UsageInfo,
    now,
    random_id,
)
from elasticmoe.errors import InvalidRequestError
from elasticmoe.outputs import RequestOutput, TokenLogprob
from elasticmoe.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

SSE_DONE = "data: [DONE]\n\n"


def sse_event(payload: BaseModel | dict[str, Any]) -> str:
    """One server-sent event carrying `payload` as JSON."""
    if isinstance(payload, BaseModel):
        return f"data: {payload.model_dump_json()}\n\n"
    return f"data: {json.dumps(payload)}\n\n"


class EngineClient(Protocol):
    @property
    def tokenizer(self) -> Any: ...
    @property
    def max_model_len(self) -> int: ...

    def generate(self, request: EngineRequest) -> AsyncGenerator[RequestOutput, None]: ...

    def adapter_names(self) -> Sequence[str]:
        """ESFT adapters loaded and accepting requests (each is served as a model id)."""
        ...


@dataclass(slots=True)
class RequestStats:
    """What one finished request reports to the observer (metrics)."""

    endpoint: str  # "completions" | "chat_completions"
    num_prompt_tokens: int
    num_output_tokens: int
    ttft_s: float | None
    e2e_s: float
    finish_reason: str | None
    # For a request that named an adapter: "resident" (there on arrival) or "swapped" (it waited for
    # the adapter's swap-in); None for the base model.
    adapter_state: str | None = None


class ServingObserver(Protocol):
    def on_request_finished(self, stats: RequestStats) -> None: ...


class SSEStream:
    """Server-sent events for one request; `aclose()` also aborts its engine requests (one per choice)."""

    def __init__(self, events: AsyncGenerator[str, None], started: Sequence[Started]) -> None:
        self._events = events
        self._sources = [choice.source for choice in started]
        self.adapter_state = choices_adapter_state(started)  # known at the first token, before the headers

    def __aiter__(self) -> AsyncIterator[str]:
        return self._events

    async def aclose(self) -> None:
        await self._events.aclose()
        for source in self._sources:
            await source.aclose()


class OpenAIServing:
    """Handlers for /v1/completions, /v1/chat/completions and /v1/models."""

    def __init__(
        self, engine: EngineClient, served_model_name: str, observer: ServingObserver | None = None,
        reasoning_parser: str | None = None,
    ) -> None:
        """`reasoning_parser`: one of `reasoning.PARSERS` (`serve --reasoning-parser`): chat answers
        return the model's thinking apart from their content."""
        if reasoning_parser is not None and reasoning_parser not in reasoning.PARSERS:
            raise ValueError(f"reasoning_parser: expected one of {reasoning.PARSERS}, got {reasoning_parser!r}")
        self.engine = engine
        self.served_model_name = served_model_name
        self.observer = observer
        self.reasoning_parser = reasoning_parser
        self.created = now()
        # NOTE: prompts become token ids here, on the renderer's threads: never on the event loop
        # (it serves every other request and the probes) nor on the engine thread (every stream).
        self.prompts = PromptRenderer(engine.tokenizer, lambda: self.engine.max_model_len)

    def check_model(self, model: str) -> str | None:
        """The adapter a request for `model` runs with (None: the base model); 404 if unknown."""
        if model == self.served_model_name:
            return None
        if model in self.engine.adapter_names():
            return model
        raise model_not_found(model)

    def show_models(self) -> ModelList:
        base = self.served_model_name
        cards = [ModelCard(id=base, created=self.created, root=base, max_model_len=self.engine.max_model_len)]
        cards += [
            ModelCard(id=name, created=self.created, root=base, parent=base, adapter_type="esft",
                      max_model_len=self.engine.max_model_len)
            for name in self.engine.adapter_names()
        ]
        return ModelList(data=cards)

    # ------------------------------------------------------------ completions

    async def create_completion(self, request: CompletionRequest) -> CompletionResponse | SSEStream:
        adapter = self.check_model(request.model)
        params = await self._sampling_params(request, request.asks_for_structure)
        prompt_ids = await self.prompts.completion(request.engine_prompt)
        response_id = random_id("cmpl")
        started = await self._start(response_id, prompt_ids, params, {}, AdapterRef(adapter, request.lora_routing),
                                    request.n)
        echo = self._echo(request, prompt_ids)
        if request.stream:
            return SSEStream(self._completion_events(request, response_id, started, echo), started)
        results = await all_or_none([self._collect(choice, "completions") for choice in started])
        choices = [
            CompletionChoice(
                index=index,
                text=echo + last.text,
                logprobs=_completion_logprobs(logprobs, 0) if request.logprobs is not None else None,
                finish_reason=last.finish_reason,
                stop_reason=last.stop_reason,
            )
            for index, (last, logprobs) in enumerate(results)
        ]
        response = CompletionResponse(
            id=response_id,
            created=started[0].created,
            model=request.model,
            choices=choices,
            usage=_usage([last for last, _ in results]),
        )
        response._adapter_state = choices_adapter_state(started)
        return response

    def _echo(self, request: CompletionRequest, prompt_ids: list[int]) -> str:
        """The text `echo` puts before each choice's: the prompt as sent, or its token ids decoded."""
        if not request.echo:
            return ""
        prompt = request.engine_prompt
        return prompt if isinstance(prompt, str) else str(self.engine.tokenizer.decode(prompt_ids))

    async def _completion_events(
        self, request: CompletionRequest, response_id: str, started: list[Started], echo: str = ""
    ) -> AsyncGenerator[str, None]:
        def chunk(choices: list[CompletionStreamChoice], usage: UsageInfo | None = None) -> str:
            return sse_event(
                CompletionStreamResponse(
                    id=response_id,
                    created=started[0].created,
                    model=request.model,
                    choices=choices,
                    usage=usage,
                )
            )

        if echo:
            for index in range(len(started)):
                yield chunk([CompletionStreamChoice(index=index, text=echo)])
        text_offsets = [0] * len(started)
        lasts: dict[int, RequestOutput] = {}
        # closed here, not left to the garbage collector: that aborts every choice (see `merged`)
        async with aclosing(merged(started, lambda choice: self._stream_outputs(choice, "completions"))) as outputs:
            async for index, out in outputs:
                if isinstance(out, str):  # an error event
                    yield out
                    break
                # NOTE: a chunk per step that made tokens, even while their text is held back (a partial
                # UTF-8 sequence, a possible stop string): clients time tokens by chunks (as with vLLM).
                # The last step's empty text rides on the finish chunk.
                if out.new_text or out.new_logprobs or (out.new_token_ids and not out.finished):
                    logprobs = None
                    if request.logprobs is not None:
                        logprobs = _completion_logprobs(out.new_logprobs or [], text_offsets[index])
                        text_offsets[index] += sum(len(t.token) for t in out.new_logprobs or [])
                    yield chunk([CompletionStreamChoice(index=index, text=out.new_text, logprobs=logprobs)])
                if out.finished:
                    lasts[index] = out
                    yield chunk(
                        [
                            CompletionStreamChoice(
                                index=index, text="", finish_reason=out.finish_reason, stop_reason=out.stop_reason
                            )
                        ]
                    )
                    if request.include_usage_chunk and len(lasts) == len(started):
                        yield chunk([], _usage(list(lasts.values())))
        yield SSE_DONE

    # ------------------------------------------------------------ chat

    async def create_chat_completion(
        self, request: ChatCompletionRequest
    ) -> ChatCompletionResponse | SSEStream:
        adapter = self.check_model(request.model)
        params = await self._sampling_params(request, request.asks_for_structure or request.tool_mode is not None)
        if request.tool_mode == "auto":
            tools.check_auto(self.prompts.chat_template())
        try:
            prompt_ids = await self.prompts.chat(request.template_messages(), request.template_tools(),
                                                 request.chat_template_kwargs)
        except InvalidRequestError:
            raise
        except Exception as exc:
            logger.info("chat template failed: %r", exc)
            raise OpenAIError(
                "messages: could not be rendered with the model's chat template", param="messages"
            ) from exc
        response_id = random_id("chatcmpl")
        started = await self._start(response_id, prompt_ids, params, {"prompt": "messages"},
                                    AdapterRef(adapter, request.lora_routing), request.n)
        if request.stream:
            return SSEStream(self._chat_events(request, response_id, started), started)
        results = await all_or_none([self._collect(choice, "chat_completions") for choice in started])
        thinking = self._thinks(request)
        choices = []
        for index, (last, logprobs) in enumerate(results):
            thought, content = reasoning.split(last.text, thinking)
            message, reason = tools.chat_message(content or "", last.finish_reason, request.tool_mode,
                                                 request.tool_name, request.parallel_tool_calls)
            if thinking:
                message.reasoning = thought
                if content is None:  # cut short while thinking: no answer yet
                    message.content = None
            choices.append(ChatCompletionChoice(
                index=index,
                message=message,
                logprobs=ChatChoiceLogprobs(content=_chat_logprobs(logprobs)) if request.logprobs else None,
                finish_reason=reason,
                stop_reason=last.stop_reason,
            ))
        response = ChatCompletionResponse(
            id=response_id,
            created=started[0].created,
            model=request.model,
            choices=choices,
            usage=_usage([last for last, _ in results]),
        )
        response._adapter_state = choices_adapter_state(started)
        return response

    async def _chat_events(
        self, request: ChatCompletionRequest, response_id: str, started: list[Started]
    ) -> AsyncGenerator[str, None]:
        def chunk(choices: list[ChatCompletionStreamChoice], usage: UsageInfo | None = None) -> str:
            return sse_event(
                ChatCompletionStreamResponse(
                    id=response_id,
                    created=started[0].created,
                    model=request.model,
                    choices=choices,
                    usage=usage,
                )
            )

        for index in range(len(started)):
            yield chunk([ChatCompletionStreamChoice(index=index, delta=DeltaMessage(role="assistant", content=""))])
        lasts: dict[int, RequestOutput] = {}
        mode = request.tool_mode
        calls = ([tools.ToolCallDeltas(mode, request.tool_name, request.parallel_tool_calls) for _ in started]
                 if mode is not None else [])
        thinking = self._thinks(request)
        thoughts = [reasoning.ReasoningStream(thinking) for _ in started] if thinking else []
        # closed here, not left to the garbage collector: that aborts every choice (see `merged`)
        async with aclosing(merged(started, lambda choice: self._stream_outputs(choice, "chat_completions"))) as outputs:
            async for index, out in outputs:
                if isinstance(out, str):
                    yield out
                    break
                thought, text = thoughts[index].feed(out.new_text, out.finished) if thinking else ("", out.new_text)
                if mode is not None:
                    call_deltas, content = calls[index].feed(text, out.finished)
                    delta = DeltaMessage(tool_calls=call_deltas or None, content=content)
                else:
                    call_deltas, delta = [], DeltaMessage(content=text if text or not thought else None)
                if thought:
                    delta.reasoning = thought
                if out.new_text or out.new_logprobs or (out.new_token_ids and not out.finished) or call_deltas:
                    logprobs = (
                        ChatChoiceLogprobs(content=_chat_logprobs(out.new_logprobs or []))
                        if request.logprobs
                        else None
                    )
                    yield chunk([ChatCompletionStreamChoice(index=index, delta=delta, logprobs=logprobs)])
                if out.finished:
                    lasts[index] = out
                    made_calls = mode is not None and calls[index].made_calls
                    yield chunk(
                        [
                            ChatCompletionStreamChoice(
                                index=index, delta=DeltaMessage(),
                                finish_reason=tools.finish_reason(mode, out.finish_reason, made_calls),
                                stop_reason=out.stop_reason,
                            )
                        ]
                    )
                    if request.include_usage_chunk and len(lasts) == len(started):
                        yield chunk([], _usage(list(lasts.values())))
        yield SSE_DONE

    def _thinks(self, request: ChatCompletionRequest) -> bool:
        """Whether the answer starts with the model's thinking, to return apart (`reasoning`): with a
        parser, unless the request turned thinking off, and never for an answer a grammar constrains
        (a JSON answer or a forced tool call holds no thinking)."""
        if request.asks_for_structure or request.tool_mode not in (None, "auto"):
            return False
        return reasoning.thinks(self.reasoning_parser, request.chat_template_kwargs)

    # ------------------------------------------------------------ shared

    async def _sampling_params(self, request: CompletionRequest | ChatCompletionRequest,
                               structured: bool) -> SamplingParams:
        """The engine's parameters for `request`: built off the event loop if `structured` (checking a
        grammar takes time: a 50 KB JSON schema ~25 ms), with its bad words as token ids."""
        params = await self.prompts.run(request.to_sampling_params) if structured else request.to_sampling_params()
        if not request.bad_words:
            return params
        return dataclasses.replace(params, bad_words_token_ids=await self.prompts.bad_words(request.bad_words))

    async def _start(
        self,
        response_id: str,
        prompt_ids: list[int],
        params: SamplingParams,
        param_renames: dict[str, str],
        adapter: AdapterRef,
        n: int = 1,
    ) -> list[Started]:
        """Submit the request's `n` choices and wait for their first outputs, so input errors become
        400s here (an adapter unloaded since `check_model`: 404)."""
        try:
            return await start_choices(self.engine, response_id, prompt_ids, params, adapter, n)
        except ValueError as exc:
            param = getattr(exc, "param", None)
            if param in param_renames:
                raise OpenAIError(
                    str(exc).replace(param, param_renames[param], 1), param=param_renames[param]
                ) from exc
            raise

    async def _collect(self, started: Started, endpoint: str) -> tuple[RequestOutput, list[TokenLogprob]]:
        """Run a request to completion; returns the last output and all token logprobs."""
        logprobs: list[TokenLogprob] = []
        last = started.first
        try:
            async for out in started.outputs():
                logprobs.extend(out.new_logprobs or [])
                last = out
        finally:
            await started.source.aclose()
        if last.finish_reason == "error":
            logger.error("request %s failed in the engine: %s", started.request_id, last.error)
            raise internal_error()
        self._report(started, last, endpoint)
        return last, logprobs

    async def _stream_outputs(self, started: Started, endpoint: str) -> AsyncGenerator[RequestOutput | str, None]:
        """Engine outputs for a stream; an engine failure becomes one final error event (a str)."""
        try:
            async for out in started.outputs():
                if out.finish_reason == "error":
                    logger.error("request %s failed in the engine: %s", started.request_id, out.error)
                    yield sse_event(internal_error().to_response())
                    return
                yield out
                if out.finished:
                    self._report(started, out, endpoint)
        except Exception as exc:
            err = to_openai_error(exc)
            if err.status_code >= 500:
                logger.exception("request %s failed while streaming", started.request_id)
            yield sse_event(err.to_response())

    def _report(self, started: Started, last: RequestOutput, endpoint: str) -> None:
        if self.observer is None:
            return
        ttft = started.ttft_s if last.num_output_tokens else None
        stats = RequestStats(
            endpoint=endpoint,
            num_prompt_tokens=last.num_prompt_tokens,
            num_output_tokens=last.num_output_tokens,
            ttft_s=ttft,
            e2e_s=time.perf_counter() - started.start,
            finish_reason=last.finish_reason,
            adapter_state=started.adapter_state(last),
        )
        try:
            self.observer.on_request_finished(stats)
        except Exception:  # metrics must never fail a request
            logger.exception("observer failed")


def _usage(lasts: list[RequestOutput]) -> UsageInfo:
    """One request's usage over its choices' last outputs: the prompt once (with what the first
    choice found of it in the prefix cache), every choice's output."""
    first = lasts[0]
    return UsageInfo.of(first.num_prompt_tokens, sum(last.num_output_tokens for last in lasts),
                        cached_tokens=min(first.num_cached_tokens, first.num_prompt_tokens))


def _completion_logprobs(logprobs: list[TokenLogprob], text_offset: int) -> CompletionLogprobs:
    """Legacy format; each `top_logprobs` dict holds the alternatives plus the sampled token."""
    result = CompletionLogprobs()
    for t in logprobs:
        result.tokens.append(t.token)
        result.token_logprobs.append(t.logprob)
        top = {text: lp for _, text, lp in t.top_logprobs}
        top.setdefault(t.token, t.logprob)
        result.top_logprobs.append(top)
        result.text_offset.append(text_offset)
        text_offset += len(t.token)
    return result


def _chat_logprobs(logprobs: list[TokenLogprob]) -> list[ChatTokenLogprob]:
    return [
        ChatTokenLogprob(
            token=t.token,
            logprob=t.logprob,
            bytes=_utf8(t.token),
            top_logprobs=[
                TopLogprob(token=text, logprob=lp, bytes=_utf8(text)) for _, text, lp in t.top_logprobs
            ],
        )
        for t in logprobs
    ]


def _utf8(text: str) -> list[int]:
    return list(text.encode("utf-8", errors="replace"))
