"""Building blocks shared by the model families.

Models are single-device and readable; expert parallelism enters only through
the dispatcher handed to each `MoEBlock`. Weights are plain tensors taken from
a `WeightProvider` and used in place.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F

from elasticmoe.config import ModelConfig
from elasticmoe.kernels.rms_norm import fused_rms_norm
from elasticmoe.layers.attention import AttentionMetadata, gqa_attend, gqa_causal, gqa_decode, paged_attention
from elasticmoe.layers.experts import grouped_experts_sorted, swiglu_mlp
from elasticmoe.layers.linear import linear
from elasticmoe.layers.lora import LoraGroups, LoraSite
from elasticmoe.layers.norm import add_rms_norm, rms_norm
from elasticmoe.layers.rotary import RotaryEmbedding
from elasticmoe.models.weights import ParamSpec

Weights = dict[str, torch.Tensor]
# route(x [T, H]) -> (weights [T, k], expert ids [T, k], the gate's probabilities [T, E] in float32)
RouteFn = Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor, torch.Tensor]]
# reroute(expert ids [T, k], ctx) -> ids [T, k]; where ESFT adapters swap base experts for their own
RerouteFn = Callable[[torch.Tensor, "ForwardContext"], torch.Tensor]


class ExpertsHook(Protocol):
    """What a MoE layer's experts run instead of the plain grouped GEMM when per-token adapters
    ride on them (LoRA: `elasticmoe.adapters.lora_slots.ExpertLora` installs one). The model
    defines the seam; the adapter packages fill it from outside."""

    top_k: int  # (slot, weight) pairs each token carries

    def experts(self, xs: torch.Tensor, slots: torch.Tensor, lora_slots: torch.Tensor,
                w13: torch.Tensor, w2: torch.Tensor, slot_rows: torch.Tensor | None = None) -> torch.Tensor:
        """Rows `xs` [N, H] sorted by expert slot `slots` [N], each with its adapters' (slots,
        weights) `lora_slots` [N, 2K] -> the experts' output [N, H]. `slot_rows` [S]: expert slot
        s's weights are `w13[slot_rows[s]]`, `w2[slot_rows[s]]` (offloaded experts' cache rows)."""
        ...


class ExpertResidency(Protocol):
    """What a MoE layer consults when its experts are offloaded (`elasticmoe.engine.expert_offload`
    installs one): the routed experts are made resident in an expert cache before they run."""

    def observe(self, layer: int, x: torch.Tensor, probs: torch.Tensor, topk_ids: torch.Tensor) -> None:
        """MoE layer `layer` routed `x` [T, H] with the gate's probabilities `probs` [T, E] to
        `topk_ids` [T, k] (the offloading policy learns)."""
        ...

    def run_experts(self, layer: int, xs: torch.Tensor, sorted_local_slots: torch.Tensor,
                    lora: tuple[ExpertsHook, torch.Tensor] | None = None) -> torch.Tensor:
        """Rows `xs` [N, H] sorted by local expert slot -> the experts' outputs [N, H] (unweighted).
        `lora` (hook, `lora_slots` [N, 2K]): the rows' adapters ride on the experts (the hook
        computes them from the cache's rows)."""
        ...


@dataclass
class ForwardContext:
    """Everything a step's forward needs besides token ids and positions."""

    attn: AttentionMetadata
    token_adapter_ids: torch.Tensor | None = None  # [T] ESFT adapter slot, -1 = base model
    # LoRA (set when the engine has LoRA slots): per token up to K (slot, weight) pairs, slot -1 =
    # none; K is fixed per engine so EP ranks exchange equal shapes. Grouped once per step.
    token_lora_slots: torch.Tensor | None = None  # [T, K]
    token_lora_weights: torch.Tensor | None = None  # [T, K]
    lora_groups: LoraGroups | None = None  # None: no LoRA token in this step
    before_layers: Callable[[torch.Tensor], None] | None = None  # sees the embeddings (learned routing)


# ---- param spec helpers -------------------------------------------------------------


def plain(name: str, shape: tuple[int, ...], *sources: str) -> ParamSpec:
    return ParamSpec(name, shape, (tuple(sources),))


def expert_specs(
    prefix: str, hf_expert: str, names: tuple[str, str, str], expert_ids: tuple[int, ...], hidden: int, inter: int
) -> list[ParamSpec]:
    """Stacked `w13` [E, 2I, H] and `w2` [E, H, I] for the given experts.

    `hf_expert` formats to a checkpoint prefix given `e`; `names` are the
    (gate, up, down) projection names inside it.
    """
    gate, up, down = names
    w13_src = tuple((f"{hf_expert.format(e=e)}.{gate}.weight", f"{hf_expert.format(e=e)}.{up}.weight") for e in expert_ids)
    w2_src = tuple((f"{hf_expert.format(e=e)}.{down}.weight",) for e in expert_ids)
    n = len(expert_ids)
    return [
        ParamSpec(f"{prefix}.w13", (n, 2 * inter, hidden), w13_src, expert_ids),
        ParamSpec(f"{prefix}.w2", (n, hidden, inter), w2_src, expert_ids),
    ]


def dense_mlp_specs(prefix: str, hf: str, hidden: int, inter: int) -> list[ParamSpec]:
    return [
        plain(f"{prefix}.w13", (2 * inter, hidden), f"{hf}.gate_proj.weight", f"{hf}.up_proj.weight"),
        plain(f"{prefix}.w2", (hidden, inter), f"{hf}.down_proj.weight"),
    ]


def lm_specs(cfg: ModelConfig) -> list[ParamSpec]:
    head_src = "model.embed_tokens.weight" if cfg.tie_word_embeddings else "lm_head.weight"
    return [
        plain("embed", (cfg.vocab_size, cfg.hidden_size), "model.embed_tokens.weight"),
        plain("norm", (cfg.hidden_size,), "model.norm.weight"),
        plain("lm_head", (cfg.vocab_size, cfg.hidden_size), head_src),
    ]


def layer_norm_specs(cfg: ModelConfig, i: int) -> list[ParamSpec]:
    hf = f"model.layers.{i}"
    return [
        plain(f"layers.{i}.input_norm", (cfg.hidden_size,), f"{hf}.input_layernorm.weight"),
        plain(f"layers.{i}.post_norm", (cfg.hidden_size,), f"{hf}.post_attention_layernorm.weight"),
    ]


# ---- layers -----------------------------------------------------------------------


class DenseMLP:
    def __init__(self, w: Weights, prefix: str) -> None:
        self.w13, self.w2 = w[f"{prefix}.w13"], w[f"{prefix}.w2"]

    def __call__(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        return swiglu_mlp(x, self.w13, self.w2)


class MoEBlock:
    """route -> reroute -> dispatch -> grouped experts -> combine (+ shared experts).

    `reroute` and `tables` are set when ESFT adapters are enabled: the weights are then
    virtual weight tensors `[E_local + N*E_max, ...]` and the layer's expert ids extend
    past the base experts (`elasticmoe.adapters.expert_map`).
    """

    def __init__(self, route: RouteFn, w: Weights, prefix: str, dispatcher, shared: DenseMLP | None = None) -> None:
        self.route = route
        self.prefix = prefix
        self.w13, self.w2 = w[f"{prefix}.w13"], w[f"{prefix}.w2"]  # [E_slots, 2I, H], [E_slots, H, I]
        self.dispatcher = dispatcher
        self.shared = shared
        self.reroute: RerouteFn | None = None
        self.tables: tuple[torch.Tensor, torch.Tensor] | None = None  # (rank, slot) of each expert id
        self.num_base_slots: int | None = None  # set with adapter slots: rows past it are sparse
        # With offloading the base experts sit in cache rows, so the ESFT slots' rows [N*E_max, ...]
        # are tensors of their own (see `adapter_rows`).
        self.esft_rows: tuple[torch.Tensor, torch.Tensor] | None = None
        self.lora: ExpertsHook | None = None  # per-token adapters on the experts (see `ExpertsHook`)
        self.offload: ExpertResidency | None = None  # experts in an expert cache (offloading)
        self.moe_index = -1  # this block's index among the model's MoE blocks (set with `offload`)
        # Tokens routed to each base expert since the model was built (this rank's tokens): the
        # expected load that placement balances and offloading warms caches by at a scale.
        self.routed_tokens: torch.Tensor | None = None

    def adapter_rows(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The ESFT adapter slots' rows (`w13`, `w2`: [N*E_max, ...]): local slot
        `num_base_slots + j` computes with row `j`."""
        if self.esft_rows is not None:
            return self.esft_rows
        assert self.num_base_slots is not None, "no ESFT adapter slots"
        return self.w13[self.num_base_slots:], self.w2[self.num_base_slots:]

    def experts(
        self, x_sorted: torch.Tensor, sorted_slot_ids: torch.Tensor, lora_slots: torch.Tensor | None = None
    ) -> torch.Tensor:
        lora = None if lora_slots is None or self.lora is None else (self.lora, lora_slots)
        if self.offload is not None:
            return self._offloaded_experts(x_sorted, sorted_slot_ids, lora)
        if lora is not None:
            return lora[0].experts(x_sorted, sorted_slot_ids, lora[1], self.w13, self.w2)
        return grouped_experts_sorted(x_sorted, sorted_slot_ids, self.w13, self.w2, self.num_base_slots)

    def _offloaded_experts(self, xs: torch.Tensor, sorted_slot_ids: torch.Tensor,
                           lora: tuple[ExpertsHook, torch.Tensor] | None) -> torch.Tensor:
        """Base experts from the expert cache (with their rows' LoRA); rows of ESFT adapter slots
        (sorted last, never with a LoRA) from the slots' own resident rows."""
        assert self.offload is not None
        if self.esft_rows is None or self.num_base_slots is None:
            return self.offload.run_experts(self.moe_index, xs, sorted_slot_ids, lora)
        num_base_rows = int(torch.searchsorted(sorted_slot_ids, self.num_base_slots))
        if num_base_rows == xs.shape[0]:
            return self.offload.run_experts(self.moe_index, xs, sorted_slot_ids, lora)
        out = torch.empty_like(xs)
        base_lora = None if lora is None else (lora[0], lora[1][:num_base_rows])
        out[:num_base_rows] = self.offload.run_experts(self.moe_index, xs[:num_base_rows],
                                                       sorted_slot_ids[:num_base_rows], base_lora)
        w13, w2 = self.esft_rows
        out[num_base_rows:] = grouped_experts_sorted(xs[num_base_rows:],
                                                     sorted_slot_ids[num_base_rows:] - self.num_base_slots, w13, w2)
        return out

    def __call__(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        topk_weights, topk_ids, probs = self.route(x)  # [T, k], [T, k], [T, E]
        counts = torch.bincount(topk_ids.reshape(-1), minlength=probs.shape[-1])
        if self.routed_tokens is None:
            self.routed_tokens = counts
        else:
            self.routed_tokens += counts
        if self.offload is not None:
            # NOTE: the gate's own routing (base expert ids), before ESFT adapters reroute: the
            # policies learn the router, whose expert maps are [L, E].
            self.offload.observe(self.moe_index, x, probs, topk_ids)
        if self.reroute is not None and ctx.token_adapter_ids is not None:
            topk_ids = self.reroute(topk_ids, ctx)
        pair_lora = None
        if self.lora is not None:  # NOTE: always, under EP: every rank must exchange the same tensors
            k = self.lora.top_k
            slots, weights = ctx.token_lora_slots, ctx.token_lora_weights
            if slots is None or weights is None:
                slots = torch.full((x.shape[0], k), -1, dtype=torch.long)
                weights = torch.zeros((x.shape[0], k))
            # (slots, weights) of each token, packed as floats (exact for slot ids), one row per pair
            pair_lora = torch.cat((slots.float(), weights.float()), dim=1).repeat_interleave(topk_ids.shape[1], 0)
        out = self.dispatcher(x, topk_ids, topk_weights, self.experts, self.tables, pair_lora)
        if self.shared is not None:
            out = out + self.shared(x, ctx)
        return out


class GQAAttention:
    """Grouped-query attention (Qwen3-MoE with per-head q/k RMSNorm, Mixtral without)."""

    def __init__(self, cfg: ModelConfig, w: Weights, prefix: str, rope: RotaryEmbedding, qk_norm: bool) -> None:
        self.qkv, self.o = w[f"{prefix}.qkv"], w[f"{prefix}.o"]
        self.q_norm = w[f"{prefix}.q_norm"] if qk_norm else None
        self.k_norm = w[f"{prefix}.k_norm"] if qk_norm else None
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.eps = cfg.rms_norm_eps
        self.rope = rope
        self.attend = gqa_attend(self.head_dim**-0.5)
        self.decode = gqa_decode(self.head_dim**-0.5)
        self.causal = gqa_causal(self.head_dim**-0.5)
        self.lora_qkv: LoraSite | None = None  # LoRA slots of q|k|v (fused) and o, when enabled
        self.lora_o: LoraSite | None = None

    @staticmethod
    def specs(cfg: ModelConfig, i: int, qk_norm: bool) -> list[ParamSpec]:
        hf, p = f"model.layers.{i}.self_attn", f"layers.{i}.attn"
        q_dim, kv_dim = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        specs = [
            plain(f"{p}.qkv", (q_dim + 2 * kv_dim, cfg.hidden_size),
                  f"{hf}.q_proj.weight", f"{hf}.k_proj.weight", f"{hf}.v_proj.weight"),
            plain(f"{p}.o", (cfg.hidden_size, q_dim), f"{hf}.o_proj.weight"),
        ]
        if qk_norm:
            specs += [plain(f"{p}.q_norm", (cfg.head_dim,), f"{hf}.q_norm.weight"),
                      plain(f"{p}.k_norm", (cfg.head_dim,), f"{hf}.k_norm.weight")]
        return specs

    def _qk_norm(self, qk: torch.Tensor) -> torch.Tensor:
        """Per-head RMSNorm of the fused q/k heads [T, H + Hkv, D]: the fused kernel on q heads and
        k heads in place of one output, else the PyTorch norm over a [H + Hkv, D] weight."""
        assert self.q_norm is not None and self.k_norm is not None
        out = torch.empty(qk.shape, dtype=qk.dtype)
        h = self.num_heads
        if (fused_rms_norm(qk[:, :h], self.q_norm, self.eps, out[:, :h]) is not None
                and fused_rms_norm(qk[:, h:], self.k_norm, self.eps, out[:, h:]) is not None):
            return out
        return rms_norm(qk, self._qk_norm_weight(), self.eps)

    def _qk_norm_weight(self) -> torch.Tensor:
        """[H + Hkv, D] norm weights for the fused q/k; rebuilt per call so the weights stay used in place."""
        assert self.q_norm is not None and self.k_norm is not None
        return torch.cat((self.q_norm.expand(self.num_heads, -1), self.k_norm.expand(self.num_kv_heads, -1)))

    def __call__(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        cache: torch.Tensor,
        lora: LoraGroups | None = None,
    ):
        num_tokens, num_qk_heads = x.shape[0], self.num_heads + self.num_kv_heads
        qkv = linear(x, self.qkv)
        if lora is not None and self.lora_qkv is not None:
            qkv = lora.add_delta(qkv, x, self.lora_qkv.a, self.lora_qkv.bt)
        qkv = qkv.view(num_tokens, num_qk_heads + self.num_kv_heads, self.head_dim)
        # One norm and one RoPE call for q and k together: at decode batch sizes per-op overhead dominates.
        qk, v = qkv[:, :num_qk_heads], qkv[:, num_qk_heads:]  # [T, H + Hkv, D], [T, Hkv, D]
        if self.q_norm is not None:
            qk = self._qk_norm(qk)
        qk = self.rope(qk, positions)
        q = qk[:, : self.num_heads]
        new_kv = torch.cat((qk[:, self.num_heads :], v), dim=1)  # [T, 2 * Hkv, D]: k heads, then v heads
        new_kv = new_kv.view(num_tokens, 2, self.num_kv_heads, self.head_dim)
        out = paged_attention(q, new_kv, cache, meta, self.attend, self.decode, self.causal)
        out = out.reshape(num_tokens, self.num_heads * self.head_dim)
        y = linear(out, self.o)
        if lora is not None and self.lora_o is not None:
            y = lora.add_delta(y, out, self.lora_o.a, self.lora_o.bt)
        return y


class DecoderLayer:
    def __init__(self, w: Weights, i: int, eps: float, attn, mlp) -> None:
        self.input_norm, self.post_norm = w[f"layers.{i}.input_norm"], w[f"layers.{i}.post_norm"]
        self.eps, self.attn, self.mlp = eps, attn, mlp

    def __call__(self, h: torch.Tensor, normed: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext,
                 cache: torch.Tensor, next_norm: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The residual stream `h` and its input norm `normed` -> (the stream after this layer, its norm by
        `next_norm`: the next layer's input norm or the model's final one). Each residual add is fused
        with the norm that follows it."""
        h, normed = add_rms_norm(h, self.attn(normed, positions, ctx.attn, cache, ctx.lora_groups), self.post_norm,
                                 self.eps)
        return add_rms_norm(h, self.mlp(normed, ctx), next_norm, self.eps)


class CausalLM:
    """A decoder-only LM over a paged KV pool `[L, num_blocks, block_size, *token_shape]`."""

    def __init__(self, cfg: ModelConfig, w: Weights, layers: list[DecoderLayer], kv_token_shape: tuple[int, ...]):
        self.cfg = cfg
        self.weights = w
        self.embed, self.norm, self.lm_head = w["embed"], w["norm"], w["lm_head"]
        self.layers = layers
        self.kv_token_shape = kv_token_shape
        # Activations' dtype; differs from the weights' when bf16 storage is computed in float32.
        self.compute_dtype = self.embed.dtype

    def moe_blocks(self) -> list[MoEBlock]:
        return [layer.mlp for layer in self.layers if isinstance(layer.mlp, MoEBlock)]

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext, kv_pool: torch.Tensor):
        """input_ids, positions: [T] -> final hidden states [T, H] (normed)."""
        h = F.embedding(input_ids, self.embed).to(self.compute_dtype)
        if ctx.before_layers is not None:
            ctx.before_layers(h)
        eps = self.cfg.rms_norm_eps
        if not self.layers:
            return rms_norm(h, self.norm, eps)
        normed = rms_norm(h, self.layers[0].input_norm, eps)
        for i, layer in enumerate(self.layers):
            next_norm = self.layers[i + 1].input_norm if i + 1 < len(self.layers) else self.norm
            h, normed = layer(h, normed, positions, ctx, kv_pool[i].view(-1, *self.kv_token_shape), next_norm)
        return normed

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return linear(hidden, self.lm_head).float()
