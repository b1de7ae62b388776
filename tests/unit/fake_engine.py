"""A deterministic stand-in for `LLMEngine` (test-only), with the same interface.

Each step emits one token per unfinished request: token id `100 + i` with text
`"w{i} "`. Every engine call records the calling thread, so tests can assert
that only the engine loop thread touches it.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

from elasticmoe.engine.engine_request import EngineRequest
from elasticmoe.errors import InvalidRequestError
from elasticmoe.outputs import RequestOutput, TokenLogprob
from elasticmoe.sampling_params import SamplingParams


class FakeTokenizer:
    eos_token_ids = (2,)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [10 + len(word) for word in text.split()]

    def decode(self, ids: list[int]) -> str:
        return " ".join(f"w{i}" for i in ids)

    def apply_chat_template(self, messages: list[dict], tools: list[dict] | None = None,
                            template_kwargs: dict | None = None) -> list[int]:
        ids = [1]
        for m in messages:
            ids += [3] + self.encode(m["content"]) + [4]
        return ids + [5]


@dataclass
class _Req:
    prompt_ids: list[int]
    params: SamplingParams
    output_ids: list[int] = field(default_factory=list)
    text: str = ""


class FakeEngine:
    def __init__(self, max_model_len: int = 64, step_delay_s: float = 0.0) -> None:
        self.step_delay_s = step_delay_s
        self.tokenizer = FakeTokenizer()
        self.max_model_len = max_model_len
        self.requests: dict[str, _Req] = {}
        self.aborted: list[str] = []
        self.thread_ids: set[int] = set()
        self.num_steps = 0
        self.step_hook: object = None  # callable run at the start of each step (to inject delays/crashes)
        self.add_hook: object = None

    def _touch(self) -> None:
        self.thread_ids.add(threading.get_ident())

    def add(self, request: EngineRequest) -> None:
        self.add_request(request.request_id, request.prompt, request.params, request.adapter.name)

    def add_request(
        self, request_id: str, prompt: str | list[int], params: SamplingParams, adapter: str | None = None
    ) -> None:
        self._touch()
        if callable(self.add_hook):
            self.add_hook()
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        if not ids:
            raise InvalidRequestError("prompt", "must not be empty")
        if len(ids) >= self.max_model_len:
            raise InvalidRequestError(
                "prompt", f"prompt has {len(ids)} tokens; the maximum is {self.max_model_len}"
            )
        self.requests[request_id] = _Req(ids, params)

    def step(self) -> list[RequestOutput]:
        self._touch()
        self.num_steps += 1
        if self.step_delay_s:
            time.sleep(self.step_delay_s)
        if callable(self.step_hook):
            self.step_hook()
        outputs = []
        for rid, req in list(self.requests.items()):
            i = len(req.output_ids)
            token, piece = 100 + i, f"w{i} "
            req.output_ids.append(token)
            req.text += piece
            max_tokens = req.params.max_tokens or self.max_model_len - len(req.prompt_ids)
            finished = len(req.output_ids) >= max_tokens
            logprobs = None
            if req.params.logprobs is not None:
                top = [(token, piece, -0.5), (999, "alt", -1.5)][: req.params.logprobs]
                logprobs = [TokenLogprob(token, piece, -0.5, top)]
            outputs.append(
                RequestOutput(
                    request_id=rid,
                    prompt_token_ids=list(req.prompt_ids),
                    new_token_ids=[token],
                    new_text=piece,
                    output_token_ids=list(req.output_ids),
                    text=req.text,
                    new_logprobs=logprobs,
                    finished=finished,
                    finish_reason="length" if finished else None,
                )
            )
            if finished:
                del self.requests[rid]
        return outputs

    def fail_all(self, exc: BaseException) -> list[RequestOutput]:
        self._touch()
        outputs = [
            RequestOutput(rid, list(req.prompt_ids), [], "", list(req.output_ids), req.text, finished=True,
                          finish_reason="error", error=repr(exc))
            for rid, req in self.requests.items()
        ]
        self.requests.clear()
        return outputs

    def abort(self, request_id: str) -> None:
        self._touch()
        if self.requests.pop(request_id, None) is not None:
            self.aborted.append(request_id)

    def has_unfinished_requests(self) -> bool:
        self._touch()
        return bool(self.requests)

    @property
    def num_running(self) -> int:
        return len(self.requests)

    @property
    def num_waiting(self) -> int:
        return 0
