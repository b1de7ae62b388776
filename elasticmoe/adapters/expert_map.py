"""ESFT expert map and batched rerouting (ExpertWeave §4.2-4.3), pure tensor logic.

Per MoE layer, a *virtual* expert id space `[M + N * E_max]`: ids below M are the
base model's experts; adapter slot `i` owns ids `M + i*E_max + δ`, where `δ` is
the index of the expert within the adapter's list for that layer. The expert map
Π has one row per adapter plus row 0 for the base model (AID -1):
`Π[i + 1, e]` is the virtual id that replaces base expert `e` for adapter `i`
(`e` itself when the adapter did not tune it).

Rerouting is one gather over the flattened map: `Π.view(-1)[(aid + 1) * M + topk]`,
for the whole batch, whatever mix of adapters and base tokens it holds.

Under expert parallelism an adapter expert lives on the rank that holds the base
expert it replaces, at local slot `num_local(rank) + i*E_max + δ` of that rank's
virtual weight tensor `[num_local + N*E_max, ...]` (ExpertWeave's `[M + N*E_max]`
per device). `rank_of` / `slot_of` map every virtual id to its rank and local slot;
the dispatcher routes with them exactly as with base experts.

Invariant: every entry of Π points at an id whose weights are loaded (a row is
cleared back to the identity *before* its expert rows are released).
"""

from __future__ import annotations

import torch

from elasticmoe.parallel.expert_placement import ExpertPlacement


class ExpertMap:
    """Π and the dispatch tables of one MoE layer for `max_adapters` slots of `max_experts` experts."""

    def __init__(self, placement: ExpertPlacement, max_adapters: int, max_experts: int) -> None:
        if max_adapters < 1 or max_experts < 1:
            raise ValueError(f"expert map: need max_adapters >= 1 and max_experts >= 1, got {max_adapters}, {max_experts}")
        m = placement.num_experts
        self.num_experts, self.max_adapters, self.max_experts = m, max_adapters, max_experts
        self.placement = placement
        self.pi = torch.arange(m, dtype=torch.long).repeat(max_adapters + 1, 1)  # [N + 1, M]
        self._pi_flat = self.pi.view(-1)
        num_virtual = m + max_adapters * max_experts
        base_rank = torch.tensor(placement.expert_to_rank, dtype=torch.long)
        base_slot = torch.tensor(placement.expert_to_slot, dtype=torch.long)
        # Unloaded virtual ids point at rank 0 / slot 0; Π never routes to them (see the invariant).
        self.rank_of = torch.zeros(num_virtual, dtype=torch.long)
        self.slot_of = torch.zeros(num_virtual, dtype=torch.long)
        self.rank_of[:m], self.slot_of[:m] = base_rank, base_slot

    def virtual_id(self, adapter: int, index: int) -> int:
        return self.num_experts + adapter * self.max_experts + index

    def local_slot(self, adapter: int, expert: int, index: int) -> int:
        """Slot of adapter `adapter`'s `index`-th expert (replacing base `expert`) on its owner rank."""
        owner = self.placement.expert_to_rank[expert]
        return len(self.placement.local_expert_ids(owner)) + adapter * self.max_experts + index

    def set_adapter(self, adapter: int, experts: tuple[int, ...]) -> None:
        """Route adapter slot `adapter`'s tokens for base experts `experts` to its own copies."""
        self._check(adapter)
        if len(experts) > self.max_experts:
            raise ValueError(f"expert map: {len(experts)} experts exceed max_experts={self.max_experts}")
        row = torch.arange(self.num_experts, dtype=torch.long)
        for index, e in enumerate(experts):
            v = self.virtual_id(adapter, index)
            self.rank_of[v] = self.placement.expert_to_rank[e]
            self.slot_of[v] = self.local_slot(adapter, e, index)
            row[e] = v
        self.pi[adapter + 1] = row  # last: tables first, so Π never points at an unset id

    def clear_adapter(self, adapter: int) -> None:
        """Route adapter slot `adapter` back to the base experts (before its rows are released)."""
        self._check(adapter)
        self.pi[adapter + 1] = torch.arange(self.num_experts, dtype=torch.long)

    def reroute(self, topk_ids: torch.Tensor, adapter_ids: torch.Tensor) -> torch.Tensor:
        """topk_ids [T, k] (base ids), adapter_ids [T] (-1 = base) -> virtual ids [T, k]. One gather."""
        flat = (adapter_ids + 1).mul_(self.num_experts).unsqueeze(1) + topk_ids
        return self._pi_flat.index_select(0, flat.view(-1)).view_as(topk_ids)

    def _check(self, adapter: int) -> None:
        if not 0 <= adapter < self.max_adapters:
            raise ValueError(f"expert map: adapter slot {adapter} outside [0, {self.max_adapters})")


def reroute_naive(
    topk_ids: torch.Tensor, adapter_ids: torch.Tensor, adapters: dict[int, dict[int, int]]
) -> torch.Tensor:
    """Reference: per-token Python rerouting (tests and the benchmark's 'naive' baseline).
    `adapters[i][e]` = virtual id replacing base expert `e` for adapter slot `i`."""
    out = topk_ids.clone()
    for t, a in enumerate(adapter_ids.tolist()):
        if a < 0:
            continue
        for j, e in enumerate(topk_ids[t].tolist()):
            out[t, j] = adapters[a].get(e, e)
    return out
