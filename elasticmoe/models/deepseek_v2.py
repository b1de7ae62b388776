"""DeepSeek-V2: multi-head latent attention (MLA) over a compressed KV cache,
shared experts, dense first layers, group-limited greedy routing, routed scaling.

The KV pool stores, per token, the normalised KV latent `c` [kv_lora_rank] and
the rotated shared key `k_pe` [qk_rope_head_dim]; keys and values are expanded
from the latent through `kv_b_proj` at attention time.

LoRA (when `elasticmoe.adapters.lora_slots` gives the attention its sites) covers the
projections that act on each token alone: `q_proj` or `q_a_proj`/`q_b_proj`,
`kv_a_proj_with_mqa` (its delta reaches the cache through the latent) and `o_proj`.
`kv_b_proj` is not a LoRA target: it is applied to cached latents of earlier steps.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from elasticmoe.config import ModelConfig
from elasticmoe.layers.attention import AttentionMetadata, kernel_causal, paged_attention
from elasticmoe.layers.linear import linear
from elasticmoe.layers.lora import LoraGroups, LoraSite
from elasticmoe.layers.norm import rms_norm
from elasticmoe.layers.rotary import RotaryEmbedding
from elasticmoe.layers.router import gate_probs, group_limited_topk_of_probs, topk_of_probs
from elasticmoe.models.common import (
    CausalLM,
    DecoderLayer,
    DenseMLP,
    MoEBlock,
    Weights,
    dense_mlp_specs,
    expert_specs,
    layer_norm_specs,
    lm_specs,
    plain,
)
from elasticmoe.models.weights import ParamSpec

EXPERT_NAMES = ("gate_proj", "up_proj", "down_proj")


class MLAttention:
    def __init__(self, cfg: ModelConfig, w: Weights, prefix: str, rope: RotaryEmbedding) -> None:
        self.num_heads = cfg.num_heads
        self.nope, self.rope_dim, self.v_dim = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
        self.kv_lora_rank = cfg.kv_lora_rank
        self.eps = cfg.rms_norm_eps
        self.q_lora = cfg.q_lora_rank is not None
        if self.q_lora:
            self.q_a, self.q_a_norm, self.q_b = w[f"{prefix}.q_a"], w[f"{prefix}.q_a_norm"], w[f"{prefix}.q_b"]
        else:
            self.q = w[f"{prefix}.q"]
        self.kv_a, self.kv_a_norm, self.kv_b = w[f"{prefix}.kv_a"], w[f"{prefix}.kv_a_norm"], w[f"{prefix}.kv_b"]
        self.o = w[f"{prefix}.o"]
        # Per-head up-projections of the latent, for the absorbed decode path (views, no copies).
        kv_b_heads = self.kv_b.view(self.num_heads, self.nope + self.v_dim, self.kv_lora_rank)
        self.w_uk, self.w_uv = kv_b_heads[:, : self.nope], kv_b_heads[:, self.nope :]  # [H, nope, C], [H, v, C]
        self.rope = rope
        self.scale = (self.nope + self.rope_dim) ** -0.5
        # Prefill on the causal kernel, keys and values expanded from the latents (as `_attend` does);
        # where it declines (e.g. head widths off the vector width) `_attend` expands them again.
        self._causal = kernel_causal(self.scale, self._keys_values)
        # LoRA sites, when enabled: the two projections of x fused (q or q_a, then kv_a), q_b, o.
        self.lora_x: LoraSite | None = None
        self.lora_q_b: LoraSite | None = None
        self.lora_o: LoraSite | None = None

    @staticmethod
    def specs(cfg: ModelConfig, i: int) -> list[ParamSpec]:
        hf, p = f"model.layers.{i}.self_attn", f"layers.{i}.attn"
        h, qk_dim = cfg.num_heads, cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
        if cfg.q_lora_rank is None:
            specs = [plain(f"{p}.q", (h * qk_dim, cfg.hidden_size), f"{hf}.q_proj.weight")]
        else:
            specs = [
                plain(f"{p}.q_a", (cfg.q_lora_rank, cfg.hidden_size), f"{hf}.q_a_proj.weight"),
                plain(f"{p}.q_a_norm", (cfg.q_lora_rank,), f"{hf}.q_a_layernorm.weight"),
                plain(f"{p}.q_b", (h * qk_dim, cfg.q_lora_rank), f"{hf}.q_b_proj.weight"),
            ]
        return specs + [
            plain(f"{p}.kv_a", (cfg.kv_lora_rank + cfg.qk_rope_head_dim, cfg.hidden_size),
                  f"{hf}.kv_a_proj_with_mqa.weight"),
            plain(f"{p}.kv_a_norm", (cfg.kv_lora_rank,), f"{hf}.kv_a_layernorm.weight"),
            plain(f"{p}.kv_b", (h * (cfg.qk_nope_head_dim + cfg.v_head_dim), cfg.kv_lora_rank),
                  f"{hf}.kv_b_proj.weight"),
            plain(f"{p}.o", (cfg.hidden_size, h * cfg.v_head_dim), f"{hf}.o_proj.weight"),
        ]

    def _decode_absorbed(self, q: torch.Tensor, kv: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """One query per sequence, attending in latent space (DeepSeek-V2 §2.1.2 weight absorption).

        q [B, H, nope+rope]; kv [B, K, C+R]; mask [B, K] -> [B, H, v]. Keys and values are
        never expanded per head: `W_uk` is folded into the query and `W_uv` applied after.
        """
        q_nope, q_pe = q.split([self.nope, self.rope_dim], dim=-1)
        w_uk, w_uv = self.w_uk.to(q.dtype), self.w_uv.to(q.dtype)  # no-ops unless bf16 storage, fp32 compute
        q_latent = torch.bmm(q_nope.transpose(0, 1), w_uk).transpose(0, 1)  # [B, H, C]
        scores = torch.bmm(torch.cat((q_latent, q_pe), dim=-1), kv.transpose(1, 2)).float() * self.scale
        scores.masked_fill_(~mask[:, None, :], float("-inf"))  # [B, H, K]
        probs = scores.softmax(dim=-1).to(kv.dtype)
        out_latent = torch.bmm(probs, kv[..., : self.kv_lora_rank])  # [B, H, C]
        return torch.bmm(out_latent.transpose(0, 1), w_uv.transpose(1, 2)).transpose(0, 1)  # [B, H, v]

    def _keys_values(self, kv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """kv [B, K, C+R] latents -> keys [B, K, H, nope+rope], values [B, K, H, v] (a view)."""
        batch, num_keys = kv.shape[:2]
        latent, k_pe = kv.split([self.kv_lora_rank, self.rope_dim], dim=-1)
        expanded = linear(latent, self.kv_b).view(batch, num_keys, self.num_heads, self.nope + self.v_dim)
        k_nope, v = expanded.split([self.nope, self.v_dim], dim=-1)
        return torch.cat((k_nope, k_pe.unsqueeze(2).expand(-1, -1, self.num_heads, -1)), dim=-1), v

    def _attend(self, q: torch.Tensor, kv: torch.Tensor, mask: torch.Tensor | None, is_causal: bool) -> torch.Tensor:
        """q [B, Q, H, nope+rope]; kv [B, K, C+R] latents -> [B, Q, H, v]."""
        if q.shape[1] == 1 and mask is not None:
            return self._decode_absorbed(q[:, 0], kv, mask.view(mask.shape[0], -1)).unsqueeze(1)
        k, v = self._keys_values(kv)
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask, is_causal=is_causal,
            scale=self.scale,
        )
        return out.transpose(1, 2)

    def __call__(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        cache: torch.Tensor,
        lora: LoraGroups | None = None,
    ):
        num_tokens = x.shape[0]
        q_in = linear(x, self.q_a if self.q_lora else self.q)  # [T, q_lora_rank] or [T, H * (nope+rope)]
        kv_in = linear(x, self.kv_a)  # [T, C + R]
        if lora is not None and self.lora_x is not None:
            delta = lora.delta(x, self.lora_x.a, self.lora_x.bt)  # [T, q_in + C + R]
            q_in, kv_in = q_in + delta[:, : q_in.shape[1]], kv_in + delta[:, q_in.shape[1] :]
        if self.q_lora:
            q_a = rms_norm(q_in, self.q_a_norm, self.eps)
            q = linear(q_a, self.q_b)
            if lora is not None and self.lora_q_b is not None:
                q = lora.add_delta(q, q_a, self.lora_q_b.a, self.lora_q_b.bt)
        else:
            q = q_in
        q_nope, q_pe = q.view(num_tokens, self.num_heads, self.nope + self.rope_dim).split([self.nope, self.rope_dim], dim=-1)
        latent, k_pe = kv_in.split([self.kv_lora_rank, self.rope_dim], dim=-1)
        latent = rms_norm(latent, self.kv_a_norm, self.eps)
        k_pe = self.rope(k_pe.unsqueeze(1), positions).squeeze(1)
        q = torch.cat((q_nope, self.rope(q_pe, positions)), dim=-1)
        out = paged_attention(q, torch.cat((latent, k_pe), dim=-1), cache, meta, self._attend, causal=self._causal)
        out = out.reshape(num_tokens, self.num_heads * self.v_dim)
        y = linear(out, self.o)
        if lora is not None and self.lora_o is not None:
            y = lora.add_delta(y, out, self.lora_o.a, self.lora_o.bt)
        return y


def param_specs(cfg: ModelConfig, local_expert_ids: tuple[int, ...]) -> list[ParamSpec]:
    specs = lm_specs(cfg)
    for i in range(cfg.num_layers):
        specs += layer_norm_specs(cfg, i) + MLAttention.specs(cfg, i)
        hf = f"model.layers.{i}.mlp"
        if cfg.is_moe_layer(i):
            specs.append(plain(f"layers.{i}.moe.router", (cfg.num_experts, cfg.hidden_size), f"{hf}.gate.weight"))
            specs += expert_specs(f"layers.{i}.moe", hf + ".experts.{e}", EXPERT_NAMES, local_expert_ids,
                                  cfg.hidden_size, cfg.moe_intermediate_size)
            if cfg.num_shared_experts:
                specs += dense_mlp_specs(f"layers.{i}.shared", f"{hf}.shared_experts", cfg.hidden_size,
                                         cfg.moe_intermediate_size * cfg.num_shared_experts)
        else:
            specs += dense_mlp_specs(f"layers.{i}.mlp", hf, cfg.hidden_size, cfg.intermediate_size)
    return specs


def kv_token_shape(cfg: ModelConfig) -> tuple[int, ...]:
    return (cfg.kv_lora_rank + cfg.qk_rope_head_dim,)


def make_route(cfg: ModelConfig, router_weight: torch.Tensor):
    router_weight_f32 = router_weight.float()  # DeepSeek routes in float32

    def route(x):
        probs = gate_probs(linear(x.float(), router_weight_f32))
        if cfg.topk_method == "group_limited_greedy":
            weights, ids = group_limited_topk_of_probs(probs, cfg.top_k, cfg.num_groups, cfg.topk_group)
        else:
            weights, ids = topk_of_probs(probs, cfg.top_k, renormalize=False)
        if cfg.norm_topk_prob and cfg.top_k > 1:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * cfg.routed_scaling_factor, ids, probs

    return route


def build(cfg: ModelConfig, w: Weights, dispatcher) -> CausalLM:
    rope = RotaryEmbedding(cfg.qk_rope_head_dim, cfg.max_position_embeddings, cfg.rope_theta, interleaved=True)
    layers = []
    for i in range(cfg.num_layers):
        attn = MLAttention(cfg, w, f"layers.{i}.attn", rope)
        mlp: MoEBlock | DenseMLP
        if cfg.is_moe_layer(i):
            shared = DenseMLP(w, f"layers.{i}.shared") if cfg.num_shared_experts else None
            mlp = MoEBlock(make_route(cfg, w[f"layers.{i}.moe.router"]), w, f"layers.{i}.moe", dispatcher, shared)
        else:
            mlp = DenseMLP(w, f"layers.{i}.mlp")
        layers.append(DecoderLayer(w, i, cfg.rms_norm_eps, attn, mlp))
    return CausalLM(cfg, w, layers, kv_token_shape(cfg))
