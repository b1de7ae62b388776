"""Per-request text state: incremental detokenization, stop checks, output deltas."""

from __future__ import annotations

from dataclasses import dataclass, field

from elasticmoe.engine.request import Request
from elasticmoe.outputs import RequestOutput, TokenLogprob
from elasticmoe.tokenizer import IncrementalDetokenizer, Tokenizer


@dataclass
class RequestTextState:
    detokenizer: IncrementalDetokenizer
    text: str = ""
    num_emitted_chars: int = 0
    num_emitted_tokens: int = 0
    pending_logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: str | int | None = None


class OutputProcessor:
    """Owns the text side of every live request.

    Stop strings are excluded from the text (as the OpenAI API does; vLLM's
    `include_stop_str_in_output` keeps them). While a
    request runs, the last `max_stop_len - 1` characters are held back from the
    stream, since they may turn out to begin a stop string.
    """

    def __init__(self, tokenizer: Tokenizer, eos_token_ids: tuple[int, ...]) -> None:
        self.tokenizer = tokenizer
        self.eos_token_ids = set(eos_token_ids)
        self.states: dict[str, RequestTextState] = {}

    def add(self, request: Request) -> None:
        detok = IncrementalDetokenizer(self.tokenizer, request.prompt_token_ids, request.params.skip_special_tokens)
        self.states[request.request_id] = RequestTextState(detok)

    def resume(self, request: Request, num_emitted_chars: int) -> None:
        """Text state of a request continuing after output tokens its client already has (see
        `EngineRequest.resume`): the detokenizer replays them; what was emitted is not again."""
        state = self.states[request.request_id]
        for token_id in request.output_token_ids:
            if token_id in self.eos_token_ids and not request.params.ignore_eos:
                continue  # never in the text (see `append_token`)
            state.text += state.detokenizer.add(token_id)
        state.num_emitted_tokens = request.num_output_tokens
        state.num_emitted_chars = min(num_emitted_chars, len(state.text))

    def restore(self, request: Request, snap) -> None:
        """Text state of a handed-over request (see engine/handover.py)."""
        detok = IncrementalDetokenizer(self.tokenizer, [], request.params.skip_special_tokens)
        detok.ids, detok.prefix_offset, detok.read_offset = list(snap.detok_ids), 0, snap.detok_read_offset
        self.states[request.request_id] = RequestTextState(
            detok, text=snap.text, num_emitted_chars=snap.num_emitted_chars,
            num_emitted_tokens=snap.num_emitted_tokens,
        )

    def remove(self, request_id: str) -> None:
        self.states.pop(request_id, None)

    def append_token(self, request: Request, token_id: int, logprob, grammar_complete: bool = False) -> bool:
        """Record a sampled token (already appended to `request.token_ids`); True if the request is
        finished. `grammar_complete`: the request's structured output is whole with this token."""
        state = self.states[request.request_id]
        params = request.params
        if logprob is not None:
            chosen, top = logprob
            text_of = self.tokenizer.token_text
            state.pending_logprobs.append(
                TokenLogprob(token_id, text_of(token_id), chosen, [(t, text_of(t), lp) for t, lp in top])
            )
        is_eos = token_id in self.eos_token_ids and not params.ignore_eos
        checked = len(state.text)  # a stop string must end after this: what came before was checked
        if not is_eos:
            state.text += state.detokenizer.add(token_id)
        may_stop = request.num_output_tokens > params.min_tokens  # the sampler held stop tokens back
        if is_eos:
            state.finish_reason, state.stop_reason = "stop", None
        elif token_id in params.stop_token_ids:
            state.finish_reason, state.stop_reason = "stop", token_id
        elif params.stop and may_stop and self._truncate_at_stop(state, params.stop, checked,
                                                                 params.include_stop_str_in_output):
            state.finish_reason = "stop"
        elif grammar_complete:
            state.finish_reason, state.stop_reason = "stop", None
        elif params.max_tokens is not None and request.num_output_tokens >= params.max_tokens:
            state.finish_reason = "length"
        elif request.num_tokens >= request.max_total_tokens:
            state.finish_reason = "length"
        return state.finish_reason is not None

    @staticmethod
    def _truncate_at_stop(state: RequestTextState, stops: list[str], checked: int, keep_stop: bool) -> bool:
        """Cut the text at the first stop string that ends after `checked` characters (the text
        before was checked already, or, under `min_tokens`, could not stop), or after it with
        `keep_stop`; the stream holds back `max_stop_len - 1` characters, so such a match never
        starts in text already sent."""
        hits = [(state.text.find(s, max(0, checked - len(s) + 1)), s) for s in stops]
        hits = [(i, s) for i, s in hits if i >= 0]
        if not hits:
            return False
        index, stop = min(hits)
        state.text = state.text[: index + len(stop) if keep_stop else index]
        state.stop_reason = stop
        return True

    def make_output(self, request: Request, finished: bool, finish_reason: str | None = None) -> RequestOutput:
        """The delta since the last output for this request, plus cumulative fields."""
        state = self.states[request.request_id]
        reason = finish_reason or state.finish_reason
        emit_upto = len(state.text)
        if not finished and request.params.stop:
            emit_upto = max(state.num_emitted_chars, emit_upto - (max(len(s) for s in request.params.stop) - 1))
        output_ids = request.output_token_ids
        out = RequestOutput(
            request_id=request.request_id,
            prompt_token_ids=request.prompt_token_ids,
            new_token_ids=output_ids[state.num_emitted_tokens :],
            new_text=state.text[state.num_emitted_chars : emit_upto],
            output_token_ids=output_ids,
            text=state.text,
            new_logprobs=state.pending_logprobs if request.params.logprobs is not None else None,
            finished=finished,
            finish_reason=reason if finished else None,
            stop_reason=state.stop_reason if finished else None,
            num_cached_tokens=request.num_cached_tokens or 0,
            waited_for_adapter=request.binding.waited,
        )
        state.num_emitted_chars, state.num_emitted_tokens = emit_upto, len(output_ids)
        state.pending_logprobs = []
        return out
