"""Factories for HMM planner tests: a synthetic model and layouts, no checkpoint."""

from __future__ import annotations

from elasticmoe.parallel.expert_placement import ExpertPlacement
from hmm.layout import DeviceSpec, Layout, ModelSizes, layout_for

# Synthetic model: 6 dense tensors (D = 4000 + 4000 + 2*1000 + 2*500 = 11000 B) and
# 2 MoE layers whose experts have w13 = 200 B and w2 = 100 B rows (X = 2*(200+100) = 600 B per expert).
D, X = 11_000, 600
BUDGET, KV = 100_000, 40_000


def make_sizes(num_experts: int = 32) -> ModelSizes:
    dense = (
        ("embed", 4000),
        ("lm_head", 4000),
        ("layers.0.attn.qkv", 1000),
        ("layers.1.attn.qkv", 1000),
        ("layers.0.moe.router", 500),
        ("layers.1.moe.router", 500),
    )
    stacks = (
        ("layers.0.moe.w13", 0, 200),
        ("layers.0.moe.w2", 0, 100),
        ("layers.1.moe.w13", 1, 200),
        ("layers.1.moe.w2", 1, 100),
    )
    return ModelSizes(num_experts, dense, stacks)


def make_devices(n: int, budget: int = BUDGET, nodes: tuple[int, ...] | None = None) -> list[DeviceSpec]:
    return [DeviceSpec(i, nodes[i] if nodes else 0, budget) for i in range(n)]


def make_layout(
    dp: int,
    num_experts: int = 32,
    kv_bytes: int | None = KV,
    budget: int = BUDGET,
    nodes: tuple[int, ...] | None = None,
    placement: ExpertPlacement | None = None,
) -> Layout:
    """DP=EP=`dp` on devices 0..dp-1 (balanced placement unless given), KV pool `kv_bytes` each."""
    return layout_for(
        None, make_sizes(num_experts), make_devices(dp, budget, nodes), dp, dp, placement, kv_bytes=kv_bytes
    )
