"""Dispatch (token, expert) pairs to the rank holding the expert, and combine results.

`LocalDispatcher` serves a rank that holds every expert. `AllToAllDispatcher`
moves the hidden states of each pair to the owning rank with `all_to_all`
over the instance's process group, runs the local experts there, and brings
the outputs back; routing weights are applied at the origin.

NOTE: `AllToAllDispatcher.__call__` runs three collectives per MoE layer. Every
rank of the group must call it for every MoE layer of every step, in the same
order, even with zero tokens: that is what "ranks step in lockstep" means.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from elasticmoe.kernels.moe_routing import combine_pairs, plan_pairs
from elasticmoe.parallel.expert_placement import ExpertPlacement

# experts(x [N, H] with rows grouped by ascending slot, those slots [N], per-row extras [N] or None)
# -> [N, H], unweighted. The extras travel with the rows (e.g. each row's LoRA adapter slot).
ExpertsFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor]
# (rank of each expert id, local slot of each expert id): a layer's own tables when ESFT adapters
# extend its id space with virtual ids (`elasticmoe.adapters.expert_map`); None: the placement's.
ExpertTables = tuple[torch.Tensor, torch.Tensor] | None


def _combine(num_tokens: int, pair_token_ids: torch.Tensor, pair_out: torch.Tensor, pair_weights: torch.Tensor):
    out = pair_out.new_zeros((num_tokens, pair_out.shape[-1]))
    return out.index_add_(0, pair_token_ids, pair_out * pair_weights.unsqueeze(-1).to(pair_out.dtype))


class LocalDispatcher:
    """All experts on this rank: sort the (token, expert) pairs by slot, run, scatter-add back
    (one kernel call each for the sort and the weighted sum where the kernels are built)."""

    def __init__(self, placement: ExpertPlacement) -> None:
        self.expert_to_slot = torch.tensor(placement.expert_to_slot, dtype=torch.long)

    def __call__(
        self,
        x: torch.Tensor,
        topk_ids: torch.Tensor,
        topk_weights: torch.Tensor,
        experts: ExpertsFn,
        tables: ExpertTables = None,
        pair_extra: torch.Tensor | None = None,
    ):
        num_tokens, top_k = topk_ids.shape
        expert_to_slot = self.expert_to_slot if tables is None else tables[1]
        # Slots are below the number of expert ids (ESFT tables map more ids than base slots).
        plan = plan_pairs(topk_ids, expert_to_slot, expert_to_slot.numel())
        if plan is not None:
            extra = pair_extra.index_select(0, plan.pair_of_row) if pair_extra is not None else None
            pair_out = experts(x.index_select(0, plan.token_of_row), plan.slot_of_row, extra)
            out = combine_pairs(pair_out, plan.row_of_pair, topk_weights)
            if out is not None:
                return out
            return _combine(num_tokens, plan.token_of_row, pair_out,
                            topk_weights.reshape(-1).index_select(0, plan.pair_of_row))
        pair_slots = expert_to_slot.index_select(0, topk_ids.reshape(-1))  # [T*k], pair p = token p // k
        order = torch.argsort(pair_slots, stable=True)
        token_ids = torch.div(order, top_k, rounding_mode="floor")
        extra = pair_extra.index_select(0, order) if pair_extra is not None else None
        pair_out = experts(x.index_select(0, token_ids), pair_slots.index_select(0, order), extra)
        return _combine(num_tokens, token_ids, pair_out, topk_weights.reshape(-1).index_select(0, order))


class AllToAllDispatcher:
    def __init__(self, placement: ExpertPlacement, rank: int, group: dist.ProcessGroup | None) -> None:
        self.expert_to_rank = torch.tensor(placement.expert_to_rank, dtype=torch.long)
        self.expert_to_slot = torch.tensor(placement.expert_to_slot, dtype=torch.long)
        self.num_ranks = placement.num_ranks
        self.rank = rank
        self.group = group

    def _exchange(self, send: torch.Tensor, send_counts: list[int], recv_counts: list[int]) -> torch.Tensor:
        recv = send.new_empty((sum(recv_counts), *send.shape[1:]))
        dist.all_to_all_single(recv, send, recv_counts, send_counts, group=self.group)
        return recv

    def __call__(
        self,
        x: torch.Tensor,
        topk_ids: torch.Tensor,
        topk_weights: torch.Tensor,
        experts: ExpertsFn,
        tables: ExpertTables = None,
        pair_extra: torch.Tensor | None = None,
    ):
        num_tokens, top_k = topk_ids.shape
        expert_to_rank, expert_to_slot = (self.expert_to_rank, self.expert_to_slot) if tables is None else tables
        flat_ids = topk_ids.reshape(-1)
        dest = expert_to_rank.index_select(0, flat_ids)
        order = torch.argsort(dest, stable=True)  # pairs grouped by destination rank
        token_ids = torch.div(order, top_k, rounding_mode="floor")
        send_counts_t = torch.bincount(dest, minlength=self.num_ranks)
        recv_counts_t = torch.empty_like(send_counts_t)
        dist.all_to_all_single(recv_counts_t, send_counts_t, group=self.group)
        send_counts, recv_counts = send_counts_t.tolist(), recv_counts_t.tolist()

        recv_x = self._exchange(x.index_select(0, token_ids), send_counts, recv_counts)
        recv_slots = self._exchange(expert_to_slot.index_select(0, flat_ids.index_select(0, order)),
                                    send_counts, recv_counts)
        # NOTE: every rank exchanges the extras or none does (all ranks of a step agree: the
        # caller passes them whenever the instance serves LoRA adapters on experts).
        recv_extra = None
        if pair_extra is not None:
            recv_extra = self._exchange(pair_extra.index_select(0, order), send_counts, recv_counts)
        # Received rows arrive grouped by source rank; group them by slot for the experts and back.
        by_slot = torch.argsort(recv_slots, stable=True)
        out_sorted = experts(recv_x.index_select(0, by_slot), recv_slots.index_select(0, by_slot),
                             recv_extra.index_select(0, by_slot) if recv_extra is not None else None)
        out = torch.empty_like(out_sorted).index_copy_(0, by_slot, out_sorted)
        back = self._exchange(out, recv_counts, send_counts)
        return _combine(num_tokens, token_ids, back, topk_weights.reshape(-1).index_select(0, order))
