"""`EngineRequest`: one request as it crosses every layer (HTTP -> router -> rank -> engine).

A frozen, picklable value: the HTTP layer builds it once (prompt already token ids, see
`entrypoints/openai/prompts.py`), and the router, the rank actor, the engine thread and the
engine take it whole, so no layer forwards loose arguments in its own order.

`resume` carries what the client has already received when the instance that ran the
request died: the engine continues from the prompt and those output tokens (their KV
recomputed), emitting only what follows, so the client sees a pause, not an error.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from elasticmoe.sampling_params import SamplingParams


@dataclass(frozen=True, slots=True)
class AdapterRef:
    """Which fine-tuned variant serves the request: one adapter by name (ESFT or LoRA), or LoRA
    adapters chosen per token (`routing`, MoLoRA's JSON form); neither is the base model."""

    name: str | None = None
    routing: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        if self.name is not None and self.routing is not None:
            from elasticmoe.errors import InvalidRequestError

            raise InvalidRequestError("lora_routing", "give either an adapter (model) or lora_routing")


BASE_MODEL = AdapterRef()


@dataclass(frozen=True, slots=True)
class ResumeState:
    """What the client already has of a request whose instance died: its output tokens and the
    characters of text streamed so far (stop strings hold some text back)."""

    output_token_ids: tuple[int, ...]
    num_emitted_chars: int


@dataclass(frozen=True, slots=True)
class EngineRequest:
    request_id: str
    prompt: str | list[int]  # token ids on the serving path; text only from the offline API
    params: SamplingParams
    adapter: AdapterRef = BASE_MODEL
    resume: ResumeState | None = None

    def resumed(self, output_token_ids: list[int], num_emitted_chars: int) -> EngineRequest:
        """This request, to continue after `output_token_ids` (none: start over, nothing was streamed)."""
        if not output_token_ids:
            return dataclasses.replace(self, resume=None)
        if not isinstance(self.prompt, list):
            raise ValueError("only a request whose prompt is token ids can resume")
        return dataclasses.replace(self, resume=ResumeState(tuple(output_token_ids), num_emitted_chars))
