"""Paged attention over a block pool, with one metadata object per step.

Tokens of a step are laid out decode-first: the first `num_decode_tokens`
tokens each belong to a different sequence decoding one token; then each
prefill span (a prompt chunk of one sequence) follows. Decodes run as one
call: a kernel that reads the blocks in place (`DecodeFn`, GQA caches), else one
batched attention call over gathered, padded blocks; each prefill span runs on its
own (causal, and over earlier context when the prefill is chunked).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from elasticmoe.kernels.causal_attention import available as causal_kernel_available
from elasticmoe.kernels.causal_attention import causal_attention_kv
from elasticmoe.kernels.paged_attention import paged_decode_attention
from elasticmoe.utils.cpu_features import detect_cpu_features


@dataclass
class PrefillSpan:
    start: int  # first token of the span in the step's token list
    num_tokens: int
    context_len: int  # tokens attended to, including this span
    block_table: torch.Tensor | None = None  # [num_blocks] of the context; None when the span is the whole context
    # [1, 1, num_tokens, num_blocks * block_size] bool, True = attend: made by the first layer that
    # needs it (a chunk no causal kernel takes), then kept for the step's other layers
    mask: torch.Tensor | None = None


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] cache slot of each new token
    block_size: int = 16
    num_decode_tokens: int = 0
    decode_block_table: torch.Tensor | None = None  # [D, max_blocks], padded with block 0
    decode_mask: torch.Tensor | None = None  # [D, 1, 1, max_blocks * block_size] bool, True = attend
    decode_context_lens: torch.Tensor | None = None  # [D] int64, tokens each decode attends to
    prefills: list[PrefillSpan] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return int(self.slot_mapping.numel())


# attend(q [B, Q, H, Dq], kv [B, K, *token_shape], mask [B|1, 1, Q, K] | None, is_causal) -> [B, Q, H, Dv]
AttendFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None, bool], torch.Tensor]
# decode(q [D, H, Dq], cache [num_slots, *token_shape], meta) -> [D, H, Dv], or None: gather and `attend`
DecodeFn = Callable[[torch.Tensor, torch.Tensor, "AttentionMetadata"], torch.Tensor | None]
# causal(q [S, Nq, H, Dq], kv [S, Nk, *token_shape]) -> [S, Nq, H, Dv], or None: `attend` runs. Each
# span's queries are its last Nq positions: query i sees keys up to Nk - Nq + i.
CausalFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor | None]


def paged_attention(
    q: torch.Tensor, new_kv: torch.Tensor, cache: torch.Tensor, meta: AttentionMetadata, attend: AttendFn,
    decode: DecodeFn | None = None, causal: CausalFn | None = None,
) -> torch.Tensor:
    """Write the step's new KV into `cache` ([num_slots, *token_shape]) and attend.

    q: [T, H, Dq]; new_kv: [T, *token_shape]. Returns [T, H, Dv] in token order. `decode` and
    `causal` are a model's kernels for the decodes and the prefill spans; where one is missing or
    declines (None), `attend` runs.
    """
    if meta.num_tokens == 0:
        return q.new_empty((0, *q.shape[1:]))
    cache.index_copy_(0, meta.slot_mapping, new_kv)
    blocks = cache.view(-1, meta.block_size, *cache.shape[1:])  # [num_blocks, block_size, *token_shape]

    def gather(block_table: torch.Tensor) -> torch.Tensor:
        # Whole blocks via index_select: far cheaper on CPU than indexing token slots.
        rows = blocks.index_select(0, block_table.reshape(-1))
        return rows.view(*block_table.shape[:-1], -1, *cache.shape[1:])  # [..., K, *token_shape]

    outs = []
    num_decodes = meta.num_decode_tokens
    if num_decodes:
        assert meta.decode_block_table is not None
        out = decode(q[:num_decodes], cache, meta) if decode is not None else None
        if out is None:
            kv = gather(meta.decode_block_table)  # [D, K_max, *token_shape]
            out = attend(q[:num_decodes].unsqueeze(1), kv, meta.decode_mask, False).squeeze(1)
        outs.append(out)
    for group in _prefill_groups(meta.prefills):
        span, num_spans = group[0], len(group)
        end = span.start + num_spans * span.num_tokens
        qs = q[span.start : end].view(num_spans, span.num_tokens, *q.shape[1:])  # [S, L, H, Dq]
        if span.block_table is None:
            kv = new_kv[span.start : end].view(num_spans, span.num_tokens, *new_kv.shape[1:])
            out = causal(qs, kv) if causal is not None else None
            if out is None:
                out = attend(qs, kv, None, True)
        else:
            kv = gather(span.block_table).unsqueeze(0)  # [1, whole blocks, *token_shape]
            out = causal(qs, kv[:, : span.context_len]) if causal is not None else None
            if out is None:
                out = _attend_chunk(qs, kv, span, attend)
        outs.append(out.flatten(0, 1))
    return outs[0] if len(outs) == 1 else torch.cat(outs)


def _attend_chunk(q: torch.Tensor, kv: torch.Tensor, span: PrefillSpan, attend: AttendFn) -> torch.Tensor:
    """A prompt chunk over its earlier context and itself where no causal kernel took it: query i
    of the chunk sees keys up to context_len - num_tokens + i. Where the earlier context is shorter
    than the chunk, this runs as one causal call over the whole context, the earlier positions'
    queries padded in (zeros) and their outputs dropped: a causal kernel skips the masked half,
    where a call with the explicit mask computes every key of every query (SDPA, Zen 5, bf16: ~85
    ms for a chunk of ~2,030 tokens over 8 earlier ones, against ~34 ms causal). Longer earlier
    contexts keep the mask (padding them would cost more than the masked half saves)."""
    prefix = span.context_len - span.num_tokens
    if prefix >= span.num_tokens:
        if span.mask is None:
            key_pos = torch.arange(kv.shape[1]).unsqueeze(0)
            span.mask = (key_pos <= torch.arange(prefix, span.context_len).unsqueeze(1))[None, None]
        return attend(q, kv, span.mask, False)
    padded = torch.cat([q.new_zeros((q.shape[0], prefix, *q.shape[2:])), q], dim=1)
    return attend(padded, kv[:, : span.context_len], None, True)[:, prefix:]


def _prefill_groups(spans: list[PrefillSpan]) -> list[list[PrefillSpan]]:
    """Consecutive whole-context spans of equal length, batched into one attention call each.

    Spans over earlier context (chunked prefill) stay alone: each has its own block table and mask.
    """
    groups: list[list[PrefillSpan]] = []
    for span in spans:
        head = groups[-1][0] if groups else None
        if head is not None and head.block_table is None and span.block_table is None and (
            head.num_tokens == span.num_tokens
        ):
            groups[-1].append(span)
        else:
            groups.append([span])
    return groups


def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float):
    """One query per sequence. q [B, H, D]; k, v [B, Hkv, K, D]; mask [B, K] (True = attend) -> [B, H, D].

    Two batched matmuls with the query heads grouped per KV head: for a single
    query this is several times faster on CPU than SDPA's flash kernel, which
    is tiled for long queries.
    """
    batch, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    # Contiguous: q may be a strided view into the fused qkv projection, which bf16 matmuls handle slowly.
    qg = q.contiguous().view(batch, num_kv_heads, num_heads // num_kv_heads, head_dim)  # [B, Hkv, G, D]
    scores = torch.matmul(qg, k.transpose(-1, -2)).float() * scale  # [B, Hkv, G, K]
    scores.masked_fill_(~mask[:, None, None, :], float("-inf"))
    probs = scores.softmax(dim=-1).to(v.dtype)
    return torch.matmul(probs, v).view(batch, num_heads, -1)


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal self-attention of whole spans. q [B, L, H, D]; k, v [B, Hkv, L, D] -> [B, L, H, D].

    The PyTorch path where the causal kernel (`kernels.causal_attention`) declines: no build, or a
    head size it does not serve. Two batched matmuls with the query heads of each KV head stacked
    along the rows. In bf16 without AMX this was ~1.7x faster on CPU than SDPA's flash kernel at
    128 tokens; it computes the masked half too, so longer spans go to SDPA
    (`CAUSAL_BMM_MAX_LEN`). In fp32 SDPA wins (it skips the masked tiles), so fp32 stays on
    SDPA, and so does bf16 where oneDNN has AMX (SDPA 4.2x faster at 128 tokens, 8.6x at 512,
    measured on such a host). Scores are kept in the model dtype and softmaxed in float32, as
    HF's eager attention does; the kernel rounds where this does.
    """
    batch, length, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    group = num_heads // num_kv_heads
    qg = q.reshape(batch, length, num_kv_heads, group, head_dim).permute(0, 2, 3, 1, 4)  # [B, Hkv, G, L, D]
    qg = qg.reshape(batch * num_kv_heads, group * length, head_dim)
    causal = torch.full((length, length), float("-inf"), dtype=q.dtype).triu_(1).repeat(group, 1)  # [G*L, L]
    scores = torch.baddbmm(causal.expand(batch * num_kv_heads, -1, -1), qg,
                           k.view(-1, length, head_dim).transpose(1, 2), alpha=scale)  # [B*Hkv, G*L, L]
    probs = scores.softmax(dim=-1, dtype=torch.float32).to(v.dtype)
    out = torch.bmm(probs, v.view(-1, length, head_dim))  # [B*Hkv, G*L, D]
    return out.view(batch, num_kv_heads, group, length, head_dim).permute(0, 3, 1, 2, 4).reshape(q.shape)


# bf16 causal prefill through SDPA's flash kernel where it runs on AMX tiles (see causal_attention).
_SDPA_ON_AMX = detect_cpu_features().bf16_gemm == "amx"
# The longest bf16 span `causal_attention` takes; longer ones go to SDPA. Zen 5 (AVX-512 + bf16
# dot products, no AMX), 2 threads, 8 heads over 2 KV heads of 64, 2,048 tokens per call, min / median
# of 20 calls in turn, bmm vs SDPA: 64 tokens 1.1 / 3.2 vs 2.6 / 2.7 ms, 128 tokens 5.4 / 5.6 vs
# 4.5 / 6.1, 256 tokens 11.3 / 16.5 vs 7.2 / 7.5, 512 tokens 34.2 / 36.8 vs 13.6 / 14.1; one span of
# 2,048 tokens 188 vs 35 ms.
CAUSAL_BMM_MAX_LEN = 128


def gqa_decode(scale: float) -> DecodeFn:
    """Decode attention of GQA caches (token_shape (2, Hkv, D)) straight from the blocks."""

    def decode(q: torch.Tensor, cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor | None:
        if meta.decode_block_table is None or meta.decode_context_lens is None:
            return None
        return paged_decode_attention(q, cache, meta.decode_block_table, meta.decode_context_lens,
                                      meta.block_size, scale)

    return decode


def kernel_causal(scale: float, keys_values: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]) -> CausalFn:
    """Causal prefill attention on the kernel (`kernels.causal_attention`): `keys_values(kv)` gives
    the spans' keys [S, Nk, Hkv, Dk] and values [S, Nk, Hkv, Dv] from what the cache holds. None
    (the model's `attend` runs) without a build, where the kernel declines the shapes, and for bf16
    where oneDNN has AMX (see causal_attention)."""

    def causal(q: torch.Tensor, kv: torch.Tensor) -> torch.Tensor | None:
        if (q.dtype == torch.bfloat16 and _SDPA_ON_AMX) or not causal_kernel_available():
            return None
        k, v = keys_values(kv)
        return causal_attention_kv(q, k, v, scale)

    return causal


def gqa_causal(scale: float) -> CausalFn:
    """`kernel_causal` for GQA caches: the K and V rows read where they are."""
    return kernel_causal(scale, lambda kv: (kv[:, :, 0], kv[:, :, 1]))


def gqa_attend(scale: float) -> AttendFn:
    """Attention for caches holding K and V per token: token_shape (2, num_kv_heads, head_dim)."""

    def attend(q: torch.Tensor, kv: torch.Tensor, mask: torch.Tensor | None, is_causal: bool) -> torch.Tensor:
        # Contiguous copies: CPU matmuls on these strided views copy far more slowly inside.
        k = kv[:, :, 0].transpose(1, 2).contiguous()  # [B, Hkv, K, D]
        v = kv[:, :, 1].transpose(1, 2).contiguous()
        if q.shape[1] == 1 and mask is not None:
            return decode_attention(q[:, 0], k, v, mask.view(mask.shape[0], -1), scale).unsqueeze(1)
        if is_causal and q.dtype != torch.float32 and not _SDPA_ON_AMX and q.shape[1] <= CAUSAL_BMM_MAX_LEN:
            return causal_attention(q, k, v, scale)
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2), k, v, attn_mask=mask, is_causal=is_causal, scale=scale, enable_gqa=True
        )
        return out.transpose(1, 2)

    return attend
