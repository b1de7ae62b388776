"""Mixtral: GQA without q/k norm, softmax top-k routing renormalised over the chosen experts."""

from __future__ import annotations

from elasticmoe.config import ModelConfig
from elasticmoe.layers.linear import linear
from elasticmoe.layers.rotary import RotaryEmbedding
from elasticmoe.layers.router import gate_probs, topk_of_probs
from elasticmoe.models.common import (
    CausalLM,
    DecoderLayer,
    GQAAttention,
    MoEBlock,
    Weights,
    expert_specs,
    layer_norm_specs,
    lm_specs,
    plain,
)
from elasticmoe.models.weights import ParamSpec

EXPERT_NAMES = ("w1", "w3", "w2")  # gate, up, down


def param_specs(cfg: ModelConfig, local_expert_ids: tuple[int, ...]) -> list[ParamSpec]:
    specs = lm_specs(cfg)
    for i in range(cfg.num_layers):
        hf = f"model.layers.{i}.block_sparse_moe"
        specs += layer_norm_specs(cfg, i) + GQAAttention.specs(cfg, i, qk_norm=False)
        specs.append(plain(f"layers.{i}.moe.router", (cfg.num_experts, cfg.hidden_size), f"{hf}.gate.weight"))
        specs += expert_specs(f"layers.{i}.moe", hf + ".experts.{e}", EXPERT_NAMES, local_expert_ids,
                              cfg.hidden_size, cfg.moe_intermediate_size)
    return specs


def kv_token_shape(cfg: ModelConfig) -> tuple[int, ...]:
    return (2, cfg.num_kv_heads, cfg.head_dim)


def make_route(cfg: ModelConfig, router_weight):
    def route(x):
        probs = gate_probs(linear(x, router_weight))
        weights, ids = topk_of_probs(probs, cfg.top_k, renormalize=True)
        return weights.to(x.dtype), ids, probs

    return route


def build(cfg: ModelConfig, w: Weights, dispatcher) -> CausalLM:
    rope = RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta, interleaved=False)
    layers = [
        DecoderLayer(
            w, i, cfg.rms_norm_eps,
            GQAAttention(cfg, w, f"layers.{i}.attn", rope, qk_norm=False),
            MoEBlock(make_route(cfg, w[f"layers.{i}.moe.router"]), w, f"layers.{i}.moe", dispatcher),
        )
        for i in range(cfg.num_layers)
    ]
    return CausalLM(cfg, w, layers, kv_token_shape(cfg))
