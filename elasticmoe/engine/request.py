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


@dataclass(eq=False)
class AdapterBinding:
    """What a request runs with, as the adapter manager bound it (`engine.adapter_manager`).

    A request uses the base model, one adapter (`name`: an ESFT adapter, whose slot is the
    AID of its tokens, or a LoRA adapter in a LoRA slot), or LoRA adapters chosen per token
    (`routing`, with `range_slots` [M]: each vocabulary range's, or each routed adapter's,
    slot, -1 for none). While an adapter it needs is not resident the request waits
    (`is_waiting`); the swapper makes it resident and assigns the slots before a later step (ESFT
    beyond the slots of a one-rank engine: `engine.esft_disk_tier`).
    """

    name: str | None = None  # its adapter; None: the base model, or routed per token
    esft_slot: int = -1  # -1: not an ESFT adapter
    lora_slot: int = -1  # -1: no LoRA slot of its own (none, waiting, or per token)
    routing: Any = None  # a `VocabRouting` or `LearnedRouting`, or None
    range_slots: torch.Tensor | None = None  # with `routing`, once all of its adapters are resident
    is_waiting: bool = False
    # It waited for an adapter's swap-in at least once (`wait`): its TTFT includes a switch. Reported
    # with its outputs (`RequestOutput.waited_for_adapter`), never cleared.
    waited: bool = False
    is_esft: bool = False  # `name` is an ESFT adapter (resident or not)
    # What the request's KV depends on besides its tokens, for the prefix cache
    # (`engine.prefix_hash`): b"" for the base model, the adapter's name and load for an adapter,
    # None where the KV is not cached (LoRA adapters chosen per token).
    cache_salt: bytes | None = b""

    @property
    def lora_names(self) -> set[str]:
        """The LoRA adapters the request needs."""
        if self.routing is not None:
            return set(self.routing.names)
        return {self.name} if self.name is not None and not self.is_esft else set()

    def wait(self) -> None:
        """An adapter it needs is not (or no longer) resident."""
        self.esft_slot, self.lora_slot, self.range_slots, self.is_waiting = -1, -1, None, True
        self.waited = True

    def esft_resident(self, slot: int) -> None:
        self.esft_slot, self.is_waiting = slot, False

    def resident(self, slot: int) -> None:
        self.lora_slot, self.is_waiting = slot, False

    def per_token(self, range_slots: torch.Tensor) -> None:
        self.lora_slot, self.range_slots, self.is_waiting = -1, range_slots, False


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
    binding: AdapterBinding = field(default_factory=AdapterBinding)
    # The prefix cache's names of its full blocks (`engine.prefix_hash`: its tokens never change, so
    # they are computed once), and how many of its blocks the block manager has named or matched.
    block_hashes: list[bytes] = field(default_factory=list)
    num_named_blocks_seen: int = 0
    # Prompt tokens its first admission found in the prefix cache (None: not admitted yet);
    # reported as `usage.prompt_tokens_details.cached_tokens`.
    num_cached_tokens: int | None = None
    # An `llguidance.LLMatcher` while its answer is constrained (`engine.structured_output`); this
    # engine's only: never in a snapshot, rebuilt from the output where the request goes.
    matcher: Any = None

    def __post_init__(self) -> None:
        self._prompt_token_ids = self.token_ids[: self.num_prompt_tokens]  # shared by every output, never copied
        if self.params.seed is not None:
            self.generator = torch.Generator().manual_seed(self.params.seed)

    @property
    def is_ready(self) -> bool:
        """Schedulable: not waiting for its LoRA adapter to be swapped into a slot."""
        return not self.binding.is_waiting

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
