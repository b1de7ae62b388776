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

from elasticmoe.parallel.expert_placement import ExpertPlacement

# experts(x [N, H], local_slot_ids [N]) -> [N, H], unweighted
ExpertsFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def _combine(num_tokens: int, pair_token_ids: torch.Tensor, pair_out: torch.Tensor, pair_weights: torch.Tensor):
    out = pair_out.new_zeros((num_tokens, pair_out.shape[-1]))
    return out.index_add_(0, pair_token_ids, pair_out * pair_weights.unsqueeze(-1).to(pair_out.dtype))


class LocalDispatcher:
    def __init__(self, placement: ExpertPlacement) -> None:
        self.expert_to_slot = torch.tensor(placement.expert_to_slot, dtype=torch.long)

    def __call__(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, experts: ExpertsFn):
        num_tokens, top_k = topk_ids.shape
        token_ids = torch.arange(num_tokens).repeat_interleave(top_k)  # [T*k]
        pair_out = experts(x[token_ids], self.expert_to_slot[topk_ids.reshape(-1)])
        return _combine(num_tokens, token_ids, pair_out, topk_weights.reshape(-1))


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

    def __call__(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, experts: ExpertsFn):
        num_tokens, top_k = topk_ids.shape
        flat_ids = topk_ids.reshape(-1)
        dest = self.expert_to_rank[flat_ids]
        order = torch.argsort(dest, stable=True)  # pairs grouped by destination rank
        token_ids = torch.arange(num_tokens).repeat_interleave(top_k)[order]
        send_counts_t = torch.bincount(dest, minlength=self.num_ranks)
        recv_counts_t = torch.empty_like(send_counts_t)
        dist.all_to_all_single(recv_counts_t, send_counts_t, group=self.group)
        send_counts, recv_counts = send_counts_t.tolist(), recv_counts_t.tolist()

        recv_x = self._exchange(x[token_ids].contiguous(), send_counts, recv_counts)
        recv_slots = self._exchange(self.expert_to_slot[flat_ids[order]], send_counts, recv_counts)
        back = self._exchange(experts(recv_x, recv_slots).contiguous(), recv_counts, send_counts)
        return _combine(num_tokens, token_ids, back, topk_weights.reshape(-1)[order])
