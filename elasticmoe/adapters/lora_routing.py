"""Per-token LoRA routing: by vocabulary range (MoLoRA §3.1), its compositional form (§3.2),
and by a learned router (§4.3, `LearnedRouting`).

A request may route each of its tokens to an adapter by the token's id: `breaks`
`b_1 < ... < b_{M-1}` split the vocabulary into M ranges and `adapters[m]` serves range m
(`None`: no adapter for that range). Per-request tables make this compositional: the
target of a token is (the request's table, the token's range), so customers with their
own adapters per modality share one batch and one dispatch. A token's id is the one
being processed at its position (the prompt token, or the last sampled one).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from elasticmoe.errors import InvalidRequestError


@dataclass(frozen=True, slots=True)
class VocabRouting:
    breaks: tuple[int, ...]  # interior range boundaries, strictly increasing, in (0, vocab)
    adapters: tuple[str | None, ...]  # one per range: len(breaks) + 1

    @classmethod
    def from_json(cls, obj: Any, vocab_size: int) -> VocabRouting:
        """Parse `{"type": "vocab", "breaks": [...], "adapters": [...]}`; errors name `lora_routing`."""
        def bad(msg: str) -> InvalidRequestError:
            return InvalidRequestError("lora_routing", msg)

        if not isinstance(obj, dict) or obj.get("type", "vocab") != "vocab":
            raise bad('want {"type": "vocab", "breaks": [...], "adapters": [...]}')
        breaks, adapters = obj.get("breaks"), obj.get("adapters")
        if not isinstance(breaks, list) or any(isinstance(b, bool) or not isinstance(b, int) for b in breaks):
            raise bad("breaks: a list of token ids")
        if any(not 0 < b < vocab_size for b in breaks) or any(a >= b for a, b in zip(breaks, breaks[1:], strict=False)):
            raise bad(f"breaks: strictly increasing token ids in (0, {vocab_size})")
        if not isinstance(adapters, list) or len(adapters) != len(breaks) + 1:
            raise bad("adapters: one adapter name (or null) per range, len(breaks) + 1 of them")
        if any(a is not None and not isinstance(a, str) for a in adapters) or all(a is None for a in adapters):
            raise bad("adapters: names of loaded LoRA adapters or null, at least one name")
        return cls(tuple(breaks), tuple(adapters))

    @property
    def names(self) -> set[str]:
        return {a for a in self.adapters if a is not None}

    def token_slots(self, token_ids: torch.Tensor, range_slots: torch.Tensor) -> torch.Tensor:
        """token ids [n] -> LoRA slot of each token (-1: no adapter), given each range's slot."""
        ranges = torch.bucketize(token_ids, torch.tensor(self.breaks, dtype=torch.long), right=True)
        return range_slots.index_select(0, ranges)


@dataclass(frozen=True)
class LearnedRouting:
    """Route each token to the top-k of `router.adapters` by the learned router (MoLoRA eq. 8)."""

    router_name: str
    router: Any  # elasticmoe.adapters.lora_router.LoraRouter

    @property
    def adapters(self) -> tuple[str, ...]:
        return tuple(self.router.adapters)

    @property
    def names(self) -> set[str]:
        return set(self.router.adapters)
