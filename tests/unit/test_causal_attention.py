"""How prefill spans attend: which kernel a causal span runs on, how a chunk over earlier
context runs, and that each equals the reference attention."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from elasticmoe.layers import attention


def _span(length: int, dtype: torch.dtype = torch.bfloat16):
    torch.manual_seed(0)
    q = torch.randn(2, length, 8, 16).to(dtype)  # 8 query heads over 2 KV heads
    kv = torch.randn(2, length, 2, 2, 16).to(dtype)  # [B, L, (K, V), Hkv, D], as the paged cache holds them
    return q, kv


def _reference(q: torch.Tensor, kv: torch.Tensor, scale: float) -> torch.Tensor:
    k, v = (kv[:, :, i].transpose(1, 2).float() for i in (0, 1))
    out = F.scaled_dot_product_attention(q.transpose(1, 2).float(), k, v, is_causal=True, scale=scale, enable_gqa=True)
    return out.transpose(1, 2)


def _needs_kernel():
    from elasticmoe.kernels import causal_attention as kernel

    if kernel._kernel() is None:
        pytest.skip("no kernel build on this host")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("length", [1, 37, 300])
def test_whole_spans_run_on_the_causal_kernel_and_equal_the_reference(monkeypatch, dtype, length):
    """A GQA model's whole prompt spans go to the causal kernel in both dtypes and at every length
    (`attend` does not run), and equal the fp32 attention."""
    from elasticmoe.layers.attention import AttentionMetadata, PrefillSpan, paged_attention

    _needs_kernel()
    monkeypatch.setattr(attention, "_SDPA_ON_AMX", False)
    q, kv = _span(length, dtype)
    spans = [PrefillSpan(i * length, length, length) for i in range(2)]
    meta = AttentionMetadata(slot_mapping=torch.arange(2 * length), block_size=4, prefills=spans)
    cache = torch.zeros(4 * (2 * length // 4 + 1), 2, 2, 16, dtype=dtype)  # whole blocks of 4
    got = paged_attention(q.flatten(0, 1), kv.flatten(0, 1), cache, meta,
                          lambda *a: pytest.fail("went to attend"), causal=attention.gqa_causal(0.25))
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), _reference(q, kv, 0.25).flatten(0, 1), atol=tol, rtol=tol)


def test_bf16_spans_stay_on_sdpa_where_it_runs_on_amx(monkeypatch):
    _needs_kernel()
    monkeypatch.setattr(attention, "_SDPA_ON_AMX", True)
    q, kv = _span(8)
    assert attention.gqa_causal(0.25)(q, kv) is None
    assert attention.gqa_causal(0.25)(q.float(), kv.float()) is not None


@pytest.mark.parametrize("length", [attention.CAUSAL_BMM_MAX_LEN, attention.CAUSAL_BMM_MAX_LEN + 1])
def test_without_the_kernel_long_bf16_spans_go_to_sdpa_and_short_ones_to_the_batched_matmuls(monkeypatch, length):
    """Where the kernel declines (no build, a head size it does not serve) and without AMX, bf16
    spans up to CAUSAL_BMM_MAX_LEN tokens run on two batched matmuls, longer ones on SDPA's flash
    kernel (the matmuls compute the masked half too: 2-5x slower from 256 tokens); both equal the
    fp32 attention to bf16 precision."""
    calls = []
    real = attention.causal_attention
    monkeypatch.setattr(attention, "_SDPA_ON_AMX", False)
    monkeypatch.setattr(attention, "causal_attention", lambda *a: calls.append(a[0].shape[1]) or real(*a))
    q, kv = _span(length)
    scale = 16**-0.5
    got = attention.gqa_attend(scale)(q, kv, None, True)
    assert calls == ([length] if length <= attention.CAUSAL_BMM_MAX_LEN else [])
    torch.testing.assert_close(got.float(), _reference(q, kv, scale), atol=2e-2, rtol=2e-2)


def test_without_the_kernel_fp32_spans_stay_on_sdpa(monkeypatch):
    monkeypatch.setattr(attention, "_SDPA_ON_AMX", False)
    monkeypatch.setattr(attention, "causal_attention", lambda *a: pytest.fail("fp32 went to the batched matmuls"))
    q, kv = _span(8, torch.float32)
    torch.testing.assert_close(attention.gqa_attend(0.25)(q, kv, None, True), _reference(q, kv, 0.25))


@pytest.mark.parametrize("with_kernel", [True, False])
@pytest.mark.parametrize(("earlier", "chunk"), [(5, 21), (21, 21), (40, 7)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_chunk_over_earlier_context_equals_the_masked_attention(monkeypatch, earlier, chunk, dtype, with_kernel):
    """A chunked prefill's later chunk: on the causal kernel, its queries the context's last ones;
    without it, with less earlier context than the chunk, one causal call over the whole context
    (queries of the earlier positions padded in and dropped), else with its explicit mask. Each
    equals attention with the chunk's lower-right causal mask."""
    from elasticmoe.layers.attention import AttentionMetadata, PrefillSpan, paged_attention

    if with_kernel:
        _needs_kernel()
    monkeypatch.setattr(attention, "_SDPA_ON_AMX", False)

    torch.manual_seed(0)
    block_size, num_blocks = 4, 32
    context = earlier + chunk
    blocks = torch.randperm(num_blocks)[: (context + block_size - 1) // block_size]
    slots = (blocks[:, None] * block_size + torch.arange(block_size)).reshape(-1)[:context]
    cache = torch.randn(num_blocks * block_size, 2, 2, 16).to(dtype)
    keys = torch.randn(context, 2, 2, 16).to(dtype)  # every position's K and V, the chunk's written by the call
    cache[slots[:earlier]] = keys[:earlier]
    q = torch.randn(chunk, 8, 16).to(dtype)
    span = PrefillSpan(0, chunk, context, block_table=blocks)  # the masked path makes its own mask
    meta = AttentionMetadata(slot_mapping=slots[earlier:], block_size=block_size, prefills=[span])
    calls = []
    attend = attention.gqa_attend(0.25)
    causal = attention.gqa_causal(0.25)
    kernel_calls = []
    got = paged_attention(q, keys[earlier:].clone(), cache, meta, lambda *a: calls.append(a[3]) or attend(*a),
                          causal=(lambda *a: kernel_calls.append(a[1].shape[1]) or causal(*a)) if with_kernel else None)
    if with_kernel:
        assert kernel_calls == [context] and calls == []  # the context's keys, no padding, no mask
    else:
        assert calls == [earlier < chunk]  # is_causal: the padded causal call, else the mask
    k, v = (keys[:, i].transpose(0, 1).float() for i in (0, 1))  # [Hkv, context, D]
    mask = torch.arange(context)[None] <= torch.arange(earlier, context)[:, None]
    want = F.scaled_dot_product_attention(q.transpose(0, 1).float(), k, v, attn_mask=mask, scale=0.25, enable_gqa=True)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), want.transpose(0, 1), atol=tol, rtol=tol)
