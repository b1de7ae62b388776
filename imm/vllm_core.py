"""`VllmEngineCore`: vLLM's engine as a handover core the lockstep loop can step.

vLLM schedules, runs the model and samples; the request-side bookkeeping is the native engine's
(`Request` + `OutputProcessor`): token ids in, our detokenizer, stop strings and limits, deltas
out. So a request's text, its stop handling and its resume after a failure or a handover are the
same whichever backend serves it, and a snapshot (`RequestSnapshot`) is the same type.

- `add`: a request (with `resume`: continuing after output tokens its client has) is submitted to
  vLLM with its prompt and those tokens as the prompt (their KV recomputed) and the remaining
  token budget; vLLM gets our stop token ids (and EOS), stop strings stay ours (vLLM runs without
  a tokenizer: `skip_tokenizer_init`);
- `step`: one `LLMEngine.step()`; each request's new tokens go through our output processor; a
  request our side finishes (a stop string) is aborted in vLLM;
- `export_requests`: every live request leaves as a snapshot (tokens so far, text state) and is
  aborted in vLLM: a replica cannot export KV, so `import_requests` on another replica submits
  the snapshot's tokens again (prefill recompute) and its stream continues where it stopped.

NOTE: single-threaded like `LLMEngine`: only the loop thread calls it once the loop runs. A seeded
request handed over continues with vLLM's generator started afresh (its state is vLLM's).
"""

from __future__ import annotations

import logging
from typing import Any

from vllm.sampling_params import RequestOutputKind
from vllm.sampling_params import SamplingParams as VllmSamplingParams

from elasticmoe.engine.engine_request import EngineRequest
from elasticmoe.engine.handover import RequestSnapshot, restore, snapshot
from elasticmoe.engine.output_processor import OutputProcessor
from elasticmoe.engine.request import Request
from elasticmoe.errors import InvalidRequestError, UnknownAdapterError
from elasticmoe.outputs import RequestOutput
from elasticmoe.tokenizer import Tokenizer

logger = logging.getLogger(__name__)


def vllm_params(request: Request, eos_token_ids: tuple[int, ...]) -> VllmSamplingParams:
    """vLLM's sampling parameters for the rest of `request` (deltas of token ids, no text)."""
    p = request.params
    remaining = request.max_total_tokens - request.num_tokens
    if p.max_tokens is not None:
        remaining = min(remaining, p.max_tokens - request.num_output_tokens)
    remaining = max(1, remaining)
    stops = list(p.stop_token_ids) + ([] if p.ignore_eos else list(eos_token_ids))
    # vLLM counts from where it got the request: what the output already holds counts towards both
    min_left = min(max(0, p.min_tokens - request.num_output_tokens), remaining)
    return VllmSamplingParams(
        temperature=p.temperature, top_p=p.top_p, top_k=p.top_k, seed=p.seed, max_tokens=remaining,
        stop_token_ids=stops, ignore_eos=True, logprobs=p.logprobs, logit_bias=p.logit_bias or None,
        repetition_penalty=p.repetition_penalty, min_tokens=min_left, min_p=p.min_p,
        allowed_token_ids=p.allowed_token_ids, detokenize=False,
        output_kind=RequestOutputKind.DELTA,
    )


class VllmEngineCore:
    """`EngineCore` + `export_requests`/`import_requests` over a vLLM `LLMEngine` (see the module docstring)."""

    def __init__(self, engine: Any, tokenizer: Tokenizer, eos_token_ids: tuple[int, ...], vocab_size: int,
                 max_model_len: int) -> None:
        self.engine = engine
        self._tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids
        self.vocab_size = vocab_size
        self._max_model_len = max_model_len
        self.output_processor = OutputProcessor(tokenizer, eos_token_ids)
        self.requests: dict[str, Request] = {}

    @property
    def tokenizer(self) -> Tokenizer:
        return self._tokenizer

    @property
    def max_model_len(self) -> int:
        return self._max_model_len

    @property
    def num_running(self) -> int:
        return len(self.requests) - self.num_waiting

    @property
    def num_waiting(self) -> int:
        """Live requests vLLM has not scheduled yet (its queue may still hold finished ones: bounded
        by what is live here)."""
        scheduler = self._scheduler()
        waiting = len(getattr(scheduler, "waiting", ())) if scheduler is not None else 0
        return min(waiting, len(self.requests))

    def _scheduler(self) -> Any:
        """vLLM's scheduler, in this process (an internal: None if its path changes)."""
        core = getattr(getattr(self.engine, "engine_core", None), "engine_core", None)
        return getattr(core, "scheduler", None)

    def kv_blocks(self) -> tuple[int, int]:
        """(blocks, free blocks) of vLLM's KV cache; (0, 0) if vLLM does not say."""
        scheduler = self._scheduler()
        pool = getattr(getattr(scheduler, "kv_cache_manager", None), "block_pool", None)
        if pool is None:
            return 0, 0
        return int(pool.num_gpu_blocks), int(pool.get_num_free_blocks())

    # ---- EngineCore ---------------------------------------------------------------------

    def add(self, request: EngineRequest) -> None:
        """Validate like the native engine (`InvalidRequestError` naming the field) and submit."""
        request_id, params = request.request_id, request.params
        if request_id in self.requests:
            raise InvalidRequestError("request_id", f"request {request_id!r} is already running")
        if request.adapter.name is not None or request.adapter.routing is not None:
            raise UnknownAdapterError(request.adapter.name or "lora_routing")  # vLLM serves the base model
        token_ids = self._token_ids(request.prompt, "prompt")
        if not token_ids:
            raise InvalidRequestError("prompt", "must not be empty")
        output_ids = self._token_ids(list(request.resume.output_token_ids), "resume") if request.resume else []
        if params.max_tokens is not None and output_ids and len(output_ids) >= params.max_tokens:
            raise InvalidRequestError("resume", f"{len(output_ids)} output tokens already reach max_tokens")
        params.check_vocabulary(self.vocab_size)
        for name in ("presence_penalty", "frequency_penalty"):
            # vLLM counts a request's output from where it was handed to it: after a handover or a
            # resume the tokens before would escape the penalty, and the answer would change.
            if getattr(params, name):
                raise InvalidRequestError(name, "is not supported by the vLLM backend (a handover would change "
                                          "what it counts); use the native backend")
        if params.bad_words_token_ids:  # vLLM takes them as words, which it tokenizes: it has no tokenizer here
            raise InvalidRequestError("bad_words", "is not supported by the vLLM backend; use the native backend")
        if params.structured_outputs is not None:
            # Its grammar is ours (vLLM runs without a tokenizer here) and a resumed request's would
            # start over in vLLM: refused by the field it came in.
            raise InvalidRequestError(params.structured_outputs.field, "structured outputs are not supported by "
                                      "the vLLM backend; use the native backend")
        limit = self._max_model_len
        if len(token_ids) >= limit:
            raise InvalidRequestError("prompt", f"prompt has {len(token_ids)} tokens; the maximum context "
                                      f"length is {limit}")
        if params.max_tokens is not None and len(token_ids) + params.max_tokens > limit:
            raise InvalidRequestError("max_tokens", f"prompt ({len(token_ids)} tokens) + max_tokens "
                                      f"({params.max_tokens}) exceeds the maximum context length {limit}")
        state = Request(request_id, token_ids + output_ids, len(token_ids), params, limit)
        self.output_processor.add(state)
        if request.resume is not None:
            self.output_processor.resume(state, request.resume.num_emitted_chars)
        self._submit(state)

    def _token_ids(self, prompt: Any, field: str) -> list[int]:
        if not isinstance(prompt, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            raise InvalidRequestError(field, "must be a list of token ids (the vLLM backend takes token ids)")
        if any(not 0 <= t < self.vocab_size for t in prompt):
            raise InvalidRequestError(field, f"token ids must be in [0, {self.vocab_size})")
        return list(prompt)

    def _submit(self, state: Request) -> None:
        self.requests[state.request_id] = state
        try:
            prompt: dict[str, Any] = {"prompt_token_ids": list(state.token_ids)}
            if state.params.cache_salt is not None:
                prompt["cache_salt"] = state.params.cache_salt  # vLLM's own prefix cache, salted alike
            self.engine.add_request(state.request_id, prompt,
                                    vllm_params(state, self.eos_token_ids))
        except Exception:
            self._forget(state.request_id)
            raise

    def step(self) -> list[RequestOutput]:
        outputs = []
        for out in self.engine.step():
            state = self.requests.get(out.request_id)
            if state is None:  # aborted on our side meanwhile
                continue
            completion = out.outputs[0]
            if state.num_cached_tokens is None and out.num_cached_tokens is not None:
                state.num_cached_tokens = min(out.num_cached_tokens, state.num_prompt_tokens)  # its prefix cache's
            finished = False
            logprobs = completion.logprobs or [None] * len(completion.token_ids)
            for token_id, lp in zip(completion.token_ids, logprobs, strict=False):
                state.token_ids.append(int(token_id))
                chosen = _logprob(int(token_id), lp, state.params.logprobs or 0)
                finished = self.output_processor.append_token(state, int(token_id), chosen)
                if finished:
                    break
            if not finished and out.finished:  # vLLM stopped it (its token budget): ours agrees
                self.output_processor.states[state.request_id].finish_reason = "length"
                finished = True
            outputs.append(self.output_processor.make_output(state, finished=finished))
            if finished:
                if not out.finished:
                    self.engine.abort_request([state.request_id])  # a stop string: vLLM would go on
                self._forget(state.request_id)
        return outputs

    def abort(self, request_id: str) -> None:
        """Drop a request (vLLM frees its KV blocks); unknown ids are ignored."""
        if self._forget(request_id):
            self.engine.abort_request([request_id])

    def fail_all(self, exc: BaseException) -> list[RequestOutput]:
        """Finish every live request with `finish_reason="error"` (after a step that raised)."""
        outputs = []
        for request_id, state in list(self.requests.items()):
            out = self.output_processor.make_output(state, finished=True, finish_reason="error")
            out.error = f"{type(exc).__name__}: {exc}"
            outputs.append(out)
            self.abort(request_id)
        return outputs

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests) or bool(self.engine.has_unfinished_requests())

    def _forget(self, request_id: str) -> bool:
        self.output_processor.remove(request_id)
        return self.requests.pop(request_id, None) is not None

    # ---- handover -----------------------------------------------------------------------

    def export_requests(self, hand_over_kv: bool) -> list[RequestSnapshot]:
        """Remove every live request and return its snapshot (no KV: vLLM's blocks are freed)."""
        snaps = [snapshot(r, self.output_processor.states[r.request_id]) for r in self.requests.values()]
        for snap in snaps:
            self.abort(snap.request_id)
        return snaps

    def import_requests(self, snaps: list[RequestSnapshot], kv_is_shared: bool) -> None:
        """Continue handed-over requests: their tokens are submitted again (KV recomputed), their
        text state restored, so the next delta follows the last one the old replica sent."""
        for snap in snaps:
            if snap.request_id in self.requests:
                raise InvalidRequestError("request_id", f"request {snap.request_id!r} is already here")
            if snap.adapter is not None or snap.lora_routing is not None:
                raise UnknownAdapterError(snap.adapter or "lora_routing")
            request = restore(snap, keep_kv=False)
            self.output_processor.restore(request, snap)
            self._submit(request)


def _logprob(token_id: int, entry: Any, k: int) -> tuple[float, list[tuple[int, float]]] | None:
    """vLLM's {token id: Logprob} of one position (its top `k` and the sampled token) -> (the sampled
    token's logprob, the top `k` alternatives by rank), as the native sampler reports them."""
    if not entry:
        return None
    chosen = entry.get(token_id)
    ranked = sorted((lp.rank, int(t), float(lp.logprob)) for t, lp in entry.items() if lp.rank is not None)
    top = [(t, lp) for rank, t, lp in ranked if rank <= k]
    return (float(chosen.logprob) if chosen is not None else float("nan")), top
