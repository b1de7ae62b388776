"""A request's state inside the engine."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from elasticmoe.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


LORA_PENDING = -2  # `Request.lora_slot` of a request whose LoRA adapter waits in host memory
LORA_PER_TOKEN = -3  # `Request.lora_slot` of a request routed per token (its adapters are resident)


@dataclass(eq=False)
class Request:
    """Tokens are `prompt + output` in one list; `num_computed_tokens` of them have KV in the cache.

    Invariant: a running request always has at least one uncomputed token (the
    last sampled one), and after preemption `num_computed_tokens` is 0 and its
    blocks are freed; its output so far is kept and recomputed.
    """

    request_id: str
    token_ids: list[int]
    num_prompt_tokens: int
    params: SamplingParams
    max_total_tokens: int  # prompt + output may not exceed this
    arrival_time: float = field(default_factory=time.monotonic)
    num_computed_tokens: int = 0
    block_ids: list[int] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    generator: torch.Generator | None = None
    num_preemptions: int = 0
    adapter: str | None = None  # ESFT adapter name; None: the base model
    adapter_slot: int = -1  # ESFT slot in the engine (-1: none), the AID of its tokens
    lora_slot: int = -1  # LoRA slot in the engine (-1: none; LORA_PENDING: its adapter is not resident yet)
    lora_routing: Any = None  # a per-token `VocabRouting` instead of one adapter (then lora_slot is
    # LORA_PER_TOKEN or LORA_PENDING, and `lora_range_slots` holds each range's slot)
    lora_range_slots: Any = None  # tensor [M] of slots (-1: none), set while every adapter is resident

    def __post_init__(self) -> None:
        self._prompt_token_ids = self.token_ids[: self.num_prompt_tokens]  # shared by every output, never copied
        if self.params.seed is not None:
            self.generator = torch.Generator().manual_seed(self.params.seed)

    @property
    def is_ready(self) -> bool:
        """Schedulable: not waiting for its LoRA adapter to be swapped into a slot."""
        return self.lora_slot != LORA_PENDING

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def prompt_token_ids(self) -> list[int]:
        return self._prompt_token_ids

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]
