"""`EsftSlots`: the ESFT adapters one engine serves over its shared base model (ExpertWeave).

N adapter slots; each MoE layer has an `ExpertMap` (Π and dispatch tables) and a
virtual weight tensor per expert param (`w13`, `w2`: `[E_local + N*E_max, ...]`,
the base experts first). Loading adapter `A` into slot `i` writes, on this rank,
the rows of the tuned experts whose base expert this rank holds (under EP the
others are written by their owner ranks), then points Π at them; unloading
points Π back at the base experts first, then lets the rows go.

Where the rows live is the weight provider's business: private memory that is
only touched when written (the default provider), or HMM pages mapped on demand.
`release_rows` (optional) returns an unloaded adapter's rows to that memory.

Not thread-safe: the engine's thread calls it, between steps.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch

from elasticmoe.adapters.expert_map import ExpertMap
from elasticmoe.errors import AdapterConflictError, AdapterLimitError
from elasticmoe.models.common import CausalLM, ForwardContext, MoEBlock
from elasticmoe.parallel.expert_placement import ExpertPlacement

logger = logging.getLogger(__name__)


# expert_weights(layer, expert, dtype) -> (w13 [2I, H], w2 [H, I]): one tuned expert's rows.
ExpertWeights = Callable[[int, int, torch.dtype], tuple[torch.Tensor, torch.Tensor]]
# release_rows(layer, param name, first row, number of rows): give an unloaded adapter's rows back.
RowReleaser = Callable[[int, str, int, int], None]


def _layer_of(block: MoEBlock) -> int:
    return int(block.prefix.split(".")[1])  # "layers.{i}.moe"


class EsftSlots:
    def __init__(
        self,
        model: CausalLM,
        placement: ExpertPlacement,
        rank: int,
        max_adapters: int,
        max_experts: int,
        release_rows: RowReleaser | None = None,
    ) -> None:
        self.placement, self.rank = placement, rank
        self.max_adapters, self.max_experts = max_adapters, max_experts
        self.release_rows = release_rows
        self.blocks: dict[int, MoEBlock] = {_layer_of(b): b for b in model.moe_blocks()}
        self.maps: dict[int, ExpertMap] = {}
        for layer, block in self.blocks.items():
            m = self.maps[layer] = ExpertMap(placement, max_adapters, max_experts)
            block.reroute = _rerouter(m)
            block.tables = (m.rank_of, m.slot_of)
            block.num_base_slots = len(placement.local_expert_ids(rank))
        self.slot_of: dict[str, int] = {}  # loaded adapter name -> slot
        self.experts_of: dict[str, dict[int, tuple[int, ...]]] = {}
        self.nbytes_of: dict[str, int] = {}  # bytes of expert rows this rank holds per adapter

    @property
    def names(self) -> list[str]:
        return sorted(self.slot_of, key=self.slot_of.__getitem__)

    def index(self, name: str) -> int | None:
        return self.slot_of.get(name)

    def check_fits(self, name: str, experts: dict[int, tuple[int, ...]], need_slot: bool = True) -> None:
        """Raise unless an adapter with these tuned experts can be loaded now (`need_slot`: into
        a slot now; else into one once free). No side effect."""
        if name in self.slot_of:
            raise AdapterConflictError(f"adapter {name!r} is already loaded")
        if need_slot and len(self.slot_of) >= self.max_adapters:
            raise AdapterLimitError(f"all {self.max_adapters} adapter slots are in use (--max-esft-adapters)")
        for layer, ids in experts.items():
            if layer not in self.blocks:
                raise ValueError(f"experts: layer {layer} is not an MoE layer of the base model")
            if len(ids) > self.max_experts:
                raise AdapterLimitError(
                    f"layer {layer} tunes {len(ids)} experts; a slot holds at most {self.max_experts} "
                    "per layer (--max-esft-experts)"
                )

    def load(
        self,
        name: str,
        experts: dict[int, tuple[int, ...]],
        expert_weights: ExpertWeights | None,
        slot: int | None = None,
    ) -> int:
        """Write this rank's rows of adapter `name` (tuned `experts`: layer -> ids) into slot
        `slot` (None: the lowest free one), then route to them. Returns the slot.
        `expert_weights=None`: the rows are already filled (by the HMM, in shared memory)."""
        self.check_fits(name, experts)
        free = set(range(self.max_adapters)) - set(self.slot_of.values())
        if slot is None:
            slot = min(free)
        elif slot not in free:
            raise AdapterConflictError(f"adapter slot {slot} is in use or outside [0, {self.max_adapters})")
        nbytes = 0
        for layer, ids in experts.items():
            block, m = self.blocks[layer], self.maps[layer]
            for index, expert in enumerate(ids):
                if self.placement.expert_to_rank[expert] != self.rank:
                    continue  # its owner rank writes it
                assert block.num_base_slots is not None
                row = m.local_slot(slot, expert, index) - block.num_base_slots
                rows_w13, rows_w2 = block.adapter_rows()
                nbytes += rows_w13[row].nbytes + rows_w2[row].nbytes
                if expert_weights is not None:
                    w13, w2 = expert_weights(layer, expert, rows_w13.dtype)
                    rows_w13[row].copy_(w13)
                    rows_w2[row].copy_(w2)
        for layer, ids in experts.items():  # NOTE: route only once every row is written
            self.maps[layer].set_adapter(slot, ids)
        self.slot_of[name], self.experts_of[name] = slot, dict(experts)
        self.nbytes_of[name] = nbytes
        logger.info("esft: adapter %r in slot %d (%d bytes of experts on rank %d)", name, slot, nbytes, self.rank)
        return slot

    def unload(self, name: str) -> None:
        """Route the adapter's tokens nowhere (Π back to base), then release its rows. The engine
        calls this only once no live request uses the adapter."""
        slot = self.slot_of.pop(name)
        experts = self.experts_of.pop(name)
        self.nbytes_of.pop(name, None)
        for layer in experts:
            self.maps[layer].clear_adapter(slot)
        if self.release_rows is not None:
            first = len(self.placement.local_expert_ids(self.rank)) + slot * self.max_experts
            for layer in experts:
                for param in ("w13", "w2"):
                    self.release_rows(layer, param, first, self.max_experts)
        logger.info("esft: adapter %r unloaded from slot %d", name, slot)


def _rerouter(m: ExpertMap) -> Callable[[torch.Tensor, ForwardContext], torch.Tensor]:
    def reroute(topk_ids: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        assert ctx.token_adapter_ids is not None
        return m.reroute(topk_ids, ctx.token_adapter_ids)

    return reroute


def describe(slots: EsftSlots | None) -> list[dict[str, Any]]:
    """Loaded adapters for status endpoints: name, slot, tuned experts, bytes on this rank."""
    if slots is None:
        return []
    return [
        {"name": n, "slot": slots.slot_of[n], "num_experts": sum(len(v) for v in slots.experts_of[n].values()),
         "bytes_on_rank": slots.nbytes_of.get(n, 0)}
        for n in slots.names
    ]
