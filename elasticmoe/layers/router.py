"""Routers: pure functions from the gate's probabilities (softmax over all experts of the router
logits, `gate_probs`) to (weights [T, k], expert ids [T, k]). The probabilities are what expert
offloading learns from (FineMoE's expert maps), so a model's route returns them too."""

from __future__ import annotations

import torch

from elasticmoe.kernels.moe_routing import topk_probs


def gate_probs(logits: torch.Tensor) -> torch.Tensor:
    """Router logits [T, E] -> the softmax over all experts [T, E], in float32."""
    return torch.softmax(logits, dim=-1, dtype=torch.float32)


def softmax_topk(logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Qwen3-MoE / Mixtral routing: softmax over all experts, keep the top k."""
    return topk_of_probs(gate_probs(logits), top_k, renormalize)


def topk_of_probs(probs: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """`softmax_topk` from the gate's probabilities (one kernel call where it is built)."""
    picked = topk_probs(probs, top_k, renormalize)
    if picked is not None:
        return picked
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def group_limited_topk(
    logits: torch.Tensor, top_k: int, num_groups: int, topk_group: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V2 routing: pick the `topk_group` groups with the best expert, then top k inside them."""
    return group_limited_topk_of_probs(gate_probs(logits), top_k, num_groups, topk_group)


def group_limited_topk_of_probs(
    probs: torch.Tensor, top_k: int, num_groups: int, topk_group: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """`group_limited_topk` from the gate's probabilities [T, E]."""
    num_tokens, num_experts = probs.shape
    group_scores = probs.view(num_tokens, num_groups, num_experts // num_groups).amax(dim=-1)  # [T, G]
    group_ids = torch.topk(group_scores, topk_group, dim=-1, sorted=False).indices
    group_mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, group_ids, True)
    expert_mask = group_mask.unsqueeze(-1).expand(-1, -1, num_experts // num_groups).reshape(num_tokens, num_experts)
    return torch.topk(probs.masked_fill(~expert_mask, 0.0), top_k, dim=-1, sorted=False)
