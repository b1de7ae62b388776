"""Routers: pure functions from router logits to (weights [T, k], expert ids [T, k])."""

from __future__ import annotations

import torch


def softmax_topk(logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Qwen3-MoE / Mixtral routing: softmax over all experts, keep the top k."""
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def group_limited_topk(
    logits: torch.Tensor, top_k: int, num_groups: int, topk_group: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V2 routing: pick the `topk_group` groups with the best expert, then top k inside them."""
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)  # [T, E]
    num_tokens, num_experts = probs.shape
    group_scores = probs.view(num_tokens, num_groups, num_experts // num_groups).amax(dim=-1)  # [T, G]
    group_ids = torch.topk(group_scores, topk_group, dim=-1, sorted=False).indices
    group_mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, group_ids, True)
    expert_mask = group_mask.unsqueeze(-1).expand(-1, -1, num_experts // num_groups).reshape(num_tokens, num_experts)
    return torch.topk(probs.masked_fill(~expert_mask, 0.0), top_k, dim=-1, sorted=False)
