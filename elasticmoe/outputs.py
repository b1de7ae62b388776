"""What the engine reports back for a request after a step.

Each `RequestOutput` carries the delta since the previous report (for streaming)
and the cumulative text/tokens (for non-streaming callers). Between processes only the
delta travels (`OutputDelta`, O(1) per token instead of O(tokens so far)); the receiver
rebuilds the cumulative fields (`OutputAccumulator`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field


@dataclass
class TokenLogprob:
    token_id: int
    token: str
    logprob: float
    top_logprobs: list[tuple[int, str, float]] = field(default_factory=list)  # (id, text, logprob)


@dataclass
class RequestOutput:
    """One report: the delta since the previous one and the cumulative fields. NOTE: rebuilt from
    deltas (`OutputAccumulator`), `text` is filled in the finished output only; streams read
    `new_text`."""

    request_id: str
    prompt_token_ids: list[int]
    new_token_ids: list[int]
    new_text: str
    output_token_ids: list[int]
    text: str
    new_logprobs: list[TokenLogprob] | None = None
    finished: bool = False
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    stop_reason: str | int | None = None  # the stop string or token id that ended the request
    error: str | None = None
    num_cached_tokens: int = 0  # prompt tokens found in the prefix cache (not computed)
    # The request waited for its adapter's swap-in (at the rank, or at the elastic server's ingress
    # for a swapped-out ESFT adapter): False for the base model and for an adapter resident on arrival.
    waited_for_adapter: bool = False

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)


@dataclass(slots=True)
class OutputDelta:
    """The part of a `RequestOutput` that is new: what a rank sends per request and step."""

    request_id: str
    new_token_ids: list[int]
    new_text: str
    new_logprobs: list[TokenLogprob] | None = None
    finished: bool = False
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    error: str | None = None
    num_cached_tokens: int = 0  # sent with the last delta only (the usage is reported at the end)
    waited_for_adapter: bool = False  # in every delta once true (one bool: the receiver keeps it)

    @classmethod
    def of(cls, out: RequestOutput) -> OutputDelta:
        return cls(out.request_id, out.new_token_ids, out.new_text, out.new_logprobs, out.finished,
                   out.finish_reason, out.stop_reason, out.error, out.num_cached_tokens if out.finished else 0,
                   out.waited_for_adapter)


class OutputAccumulator:
    """Rebuilds a request's `RequestOutput`s from its deltas (the receiver's side of the stream).

    Starts from the prompt and what the client already has (a request resumed after a failure
    or handed over keeps its text: see `EngineRequest.resume`)."""

    def __init__(self, prompt_token_ids: Sequence[int], output_token_ids: Sequence[int] = (), text: str = "") -> None:
        self.prompt_token_ids = list(prompt_token_ids)
        self.output_token_ids = list(output_token_ids)
        self._text = [text] if text else []
        self.num_chars = len(text)  # characters of text received so far
        # Whether the request waited for its adapter's swap-in anywhere (a rank's delta says so, or
        # the receiver saw it wait before routing it): kept once true, in every output rebuilt.
        self.waited_for_adapter = False

    def add(self, delta: OutputDelta) -> RequestOutput:
        self.output_token_ids += delta.new_token_ids
        if delta.new_text:
            self._text.append(delta.new_text)
            self.num_chars += len(delta.new_text)
        # NOTE: the cumulative text is joined only when the request ends (a stream reads deltas).
        text = "".join(self._text) if delta.finished else ""
        self.waited_for_adapter |= delta.waited_for_adapter
        return RequestOutput(delta.request_id, self.prompt_token_ids, delta.new_token_ids, delta.new_text,
                             self.output_token_ids, text, delta.new_logprobs, delta.finished,
                             delta.finish_reason, delta.stop_reason, delta.error, delta.num_cached_tokens,
                             self.waited_for_adapter)
