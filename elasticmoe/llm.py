"""Offline API: `LLM(model).generate(prompts, SamplingParams(...))`."""

from __future__ import annotations

import itertools

import torch

from elasticmoe.config import EngineConfig, parse_engine_dtype
from elasticmoe.engine.llm_engine import LLMEngine
from elasticmoe.outputs import RequestOutput
from elasticmoe.sampling_params import SamplingParams


class LLM:
    def __init__(self, model: str, dtype: str | torch.dtype | None = "bfloat16", **engine_kwargs) -> None:
        """`dtype`: "float32", "bfloat16", or "auto" (the fastest exact one for the checkpoint here)."""
        self.engine = LLMEngine(EngineConfig(model=model, dtype=parse_engine_dtype(dtype), **engine_kwargs))
        self._ids = itertools.count()

    def generate(
        self, prompts: str | list[int] | list[str] | list[list[int]], params: SamplingParams | None = None
    ) -> list[RequestOutput]:
        """Run all prompts to completion; results come back in prompt order.

        A string or a list of token ids is one prompt; a list of those is a batch.
        """
        batch: list = [prompts] if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)) else prompts
        params = params or SamplingParams()
        order = []
        for prompt in batch:
            request_id = f"offline-{next(self._ids)}"
            self.engine.add_request(request_id, prompt, params)
            order.append(request_id)
        final: dict[str, RequestOutput] = {}
        while self.engine.has_unfinished_requests():
            for out in self.engine.step():
                if out.finished:
                    final[out.request_id] = out
        return [final[r] for r in order]

    def chat(self, messages: list[dict], params: SamplingParams | None = None) -> RequestOutput:
        return self.generate([self.engine.tokenizer.apply_chat_template(messages)], params)[0]
