"""Our CPU kernels equal the PyTorch computation they replace, for every ISA build this host runs."""

from __future__ import annotations

import pytest
import torch

from elasticmoe.kernels import causal_attention as ca
from elasticmoe.kernels import grouped_gemm as gg
from elasticmoe.kernels import moe_routing as mr
from elasticmoe.kernels import paged_attention as pa
from elasticmoe.kernels.build import load_kernel
from elasticmoe.layers.attention import decode_attention
from elasticmoe.utils.cpu_features import detect_cpu_features

_ORDER = ["avx2", "avx512", "avx512_bf16", "amx"]
ISAS = _ORDER[: _ORDER.index(detect_cpu_features().kernel_isa) + 1] if detect_cpu_features().kernel_isa in _ORDER else []
DTYPES = [(torch.float32, torch.float32), (torch.float32, torch.bfloat16), (torch.bfloat16, torch.bfloat16)]


@pytest.fixture(params=ISAS)
def isa(request, monkeypatch):
    """Run the kernels of one ISA build (each build this CPU can execute)."""
    if load_kernel("grouped_gemm", request.param) is None:
        pytest.skip("no C++ compiler")
    for module in (gg, pa, mr, ca):
        monkeypatch.setattr(module, "load_kernel", lambda n, _isa=request.param: load_kernel(n, _isa))
    clears = (gg._library.cache_clear, pa._kernel.cache_clear, mr._library.cache_clear, ca._kernel.cache_clear)
    for clear in clears:
        clear()
    yield request.param
    for clear in clears:
        clear()


@pytest.mark.parametrize(("x_dtype", "w_dtype"), DTYPES)
@pytest.mark.parametrize("num_rows", [0, 1, 7, 300])
def test_grouped_gemm_equals_per_slot_matmul(isa, x_dtype, w_dtype, num_rows):
    torch.manual_seed(0)
    num_slots, n_out, k = 6, 21, 70  # a partial weight-row block and a K tail
    w = torch.randn(num_slots + 2, n_out, k + 3).to(w_dtype)[:, :, 1 : k + 1]  # strided view, as slices are
    slots = torch.randint(0, num_slots, (num_rows,)).sort().values
    slots[slots == 2] = 3  # a slot without rows is skipped
    x = torch.randn(num_rows, k).to(x_dtype)
    offsets = gg.slot_offsets(slots, num_slots)
    assert gg.has_grouped_gemm(x_dtype, w_dtype)
    got = gg.grouped_gemm(x, offsets, w)
    want = torch.stack([x[i].float() @ w[s].float().T for i, s in enumerate(slots.tolist())]) if num_rows else got
    tol = 1e-5 if x_dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)
    assert got.dtype == x_dtype


@pytest.mark.parametrize(("x_dtype", "w_dtype"), DTYPES)
@pytest.mark.parametrize("num_rows", [0, 1, 7, 300])
@pytest.mark.parametrize(("k", "n_out"), [(8, 512), (16, 300), (3, 21)])
def test_grouped_expand_equals_per_slot_matmul_with_transposed_weights(isa, x_dtype, w_dtype, num_rows, k, n_out):
    """LoRA's second projection: x [N, r] times each slot's B stored transposed, [r, out] (columns in
    vectors and a tail of single columns: 300 and 21 outputs)."""
    torch.manual_seed(0)
    num_slots = 6
    wt = torch.randn(num_slots, k, n_out + 5).to(w_dtype)[:, :, 2 : n_out + 2]  # strided rows, as slices are
    slots = torch.randint(0, num_slots, (num_rows,)).sort().values
    slots[slots == 2] = 3  # a slot without rows is skipped
    x = torch.randn(num_rows, k).to(x_dtype)
    got = gg.grouped_expand(x, gg.slot_offsets(slots, num_slots), wt)
    assert got is not None and got.dtype == x_dtype and got.shape == (num_rows, n_out)
    if num_rows:
        want = torch.stack([x[i].float() @ wt[s].float() for i, s in enumerate(slots.tolist())])
        tol = 1e-5 if x_dtype == torch.float32 else 2e-2
        torch.testing.assert_close(got.float(), want, atol=tol, rtol=tol)


@pytest.mark.parametrize(("x_dtype", "w_dtype"), DTYPES)
@pytest.mark.parametrize(("num_rows", "num_slots"), [(1, 1), (7, 3), (64, 16), (64, 64), (300, 2)])
@pytest.mark.parametrize("permuted", [False, True], ids=["rows-in-order", "rows-permuted"])
def test_grouped_lora_add_equals_both_kernels_and_the_add(isa, x_dtype, w_dtype, num_rows, num_slots, permuted):
    """LoRA's whole product in one region, added into each pair's output row, gives the very values of
    `grouped_gemm`, `grouped_expand` and PyTorch's add (rank 12: a partial shrink block; 300 outputs:
    a column tail); where `grouped_gemm` would run on panels (300 rows in 2 groups) or AMX tiles it
    declines and leaves the output as it was."""
    torch.manual_seed(0)
    rank, n_in, n_out, num_keys = 12, 70, 300, 64
    a = (torch.randn(num_keys, rank, n_in + 2) * 0.1).to(w_dtype)[:, :, 1 : n_in + 1]  # strided view
    bt = (torch.randn(num_keys, rank, n_out) * 0.1).to(w_dtype)
    keys = (torch.arange(num_rows) % num_slots).sort().values  # pairs grouped by key
    offsets = gg.slot_offsets(keys, num_keys)
    x = torch.randn(num_rows, n_in).to(x_dtype)
    rows = torch.randperm(num_rows) if permuted else None
    y = torch.randn(num_rows, n_out).to(x_dtype)
    delta = gg.grouped_expand(gg.grouped_gemm(x, offsets, a), offsets, bt)
    want = y.clone()
    if rows is None:
        want = want + delta
    else:
        want[rows] = want[rows] + delta
    got = y.clone()
    if gg.grouped_lora_add(got, x, rows, offsets, a, bt):
        assert torch.equal(got, want)
    else:
        assert num_rows / num_slots >= 16 or isa == "amx"  # panels, or AMX tiles
        assert torch.equal(got, y)


@pytest.mark.parametrize(("x_dtype", "w_dtype"), DTYPES)
@pytest.mark.parametrize("num_rows", [1, 7, 40, 300])
@pytest.mark.parametrize("inter", [32, 20])
def test_grouped_swiglu_equals_silu_gate_times_up(isa, x_dtype, w_dtype, num_rows, inter):
    """The fused first projection + activation of the experts (AMX builds: bf16 weights; AVX-512
    builds with bf16 dot products: bf16 activations and weights, on the dot kernel or, from 16
    rows per slot, pair panels; every build: fp32 activations, on the dot kernel or, from 32 rows
    per slot, packed panels; 20 columns leave partial blocks) equals the two steps it replaces;
    elsewhere it declines and the caller runs them."""
    torch.manual_seed(0)
    num_slots, k = 5, 67  # a K tail for every build, and an odd one (the last bf16 pair is half empty)
    w13 = torch.randn(num_slots + 1, 2 * inter, k + 2).to(w_dtype)[:, :, 1 : k + 1]  # strided view
    slots = torch.randint(0, num_slots, (num_rows,)).sort().values
    slots[slots == 2] = 3
    x = torch.randn(num_rows, k).to(x_dtype)
    offsets = gg.slot_offsets(slots, num_slots)
    got = gg.grouped_swiglu(x, offsets, w13)
    fused = (isa == "amx" and w_dtype == torch.bfloat16 and inter % 16 == 0) or (
        isa in ("avx512_bf16", "amx") and x_dtype == w_dtype == torch.bfloat16) or x_dtype == torch.float32
    if not fused:
        assert got is None
        return
    assert got is not None and got.dtype == x_dtype and got.shape == (num_rows, inter)
    projected = torch.stack([x[i].float() @ w13[s].float().T for i, s in enumerate(slots.tolist())]).to(x_dtype)
    gate, up = projected.chunk(2, dim=-1)  # rounded as the unfused kernel's output is
    want = torch.nn.functional.silu(gate) * up
    tol = 1e-4 if x_dtype == torch.float32 else 2e-2  # fp32: another summation order than the reference's
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)
    rows = torch.tensor([4, 0, 1, 3, 2, 5])  # slot s computes with weight row rows[s]
    pool = torch.full_like(w13, float("nan"))
    pool[rows[:num_slots]] = w13[:num_slots]
    torch.testing.assert_close(gg.grouped_swiglu(x, offsets, pool, rows[:num_slots]).float(), got.float())


def _slot_rows_case(x_dtype: torch.dtype, w_dtype: torch.dtype):
    torch.manual_seed(0)
    pool = torch.full((7, 21, 70), float("nan")).to(w_dtype)
    rows = torch.tensor([5, 0, 3])
    pool[rows] = torch.randn(3, 21, 70).to(w_dtype)
    counts = [2, 0, 4]
    x = torch.randn(sum(counts), 70).to(x_dtype)
    offsets = torch.tensor([0, 2, 2, 6])
    want = torch.cat([x[0:2].float() @ pool[5].float().T, x[2:6].float() @ pool[3].float().T])
    return x, offsets, pool, rows, want, 1e-5 if x_dtype == torch.float32 else 2e-2


@pytest.mark.parametrize(("x_dtype", "w_dtype"), DTYPES)
def test_grouped_gemm_with_slot_rows_reads_each_groups_own_weight_row(isa, x_dtype, w_dtype):
    """An expert cache's groups (experts in local order) read the pool rows that hold them; the
    rows in between are never read."""
    x, offsets, pool, rows, want, tol = _slot_rows_case(x_dtype, w_dtype)
    torch.testing.assert_close(gg.grouped_gemm(x, offsets, pool, rows).float(), want, atol=tol, rtol=tol)
    with pytest.raises(ValueError, match="slot_rows"):
        gg.grouped_gemm(x, offsets, pool, rows[:2])


@pytest.mark.parametrize(("x_dtype", "w_dtype"), DTYPES)
def test_grouped_gemm_of_many_rows_per_slot_reads_each_groups_own_weight_row(isa, x_dtype, w_dtype):
    """Groups of many rows (prefill; the packed-panel path, from 32 rows per slot; bf16 on AVX-512
    with bf16 dot products the pair-panel path, from 16): partial
    panels (37 = 2 x 16 + 5 weight rows), a K tail, strided weights, pool rows out of order, and
    the rows in between never read, inputs whose rows are further apart than K."""
    torch.manual_seed(0)
    n_out, k = 37, 67
    pool = torch.full((6, n_out, k + 2), float("nan")).to(w_dtype)[:, :, 1 : k + 1]
    rows = torch.tensor([4, 1, 2])
    pool[rows] = torch.randn(3, n_out, k).to(w_dtype)
    counts = [45, 0, 40]
    x = torch.randn(sum(counts), k + 5).to(x_dtype)[:, 2 : k + 2]  # rows further apart than K
    offsets = torch.tensor([0, 45, 45, 85])
    want = torch.cat([x[:45].float() @ pool[4].float().T, x[45:].float() @ pool[2].float().T])
    got = gg.grouped_gemm(x, offsets, pool, rows)
    tol = 1e-5 if x_dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), want, atol=tol, rtol=tol)
    assert got.dtype == x_dtype


def test_grouped_gemm_with_slot_rows_without_the_kernel(monkeypatch):
    monkeypatch.setattr(gg, "_kernel", lambda: None)
    x, offsets, pool, rows, want, tol = _slot_rows_case(torch.float32, torch.float32)
    torch.testing.assert_close(gg.grouped_gemm(x, offsets, pool, rows), want, atol=tol, rtol=tol)


@pytest.mark.parametrize("w_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_threads", [1, 3, 64])
def test_grouped_gemm_splits_work_among_any_number_of_threads(isa, num_threads, w_dtype):
    """Each thread takes a contiguous run of (slot, weight block) tasks of about equal cost and
    then helps with the others': every task runs exactly once whether threads outnumber the
    tasks, some runs are empty, or the rows are skewed to one slot (bf16 weights: the AMX path's
    packing and tiles on AMX builds)."""
    from elasticmoe.kernels.build import kernel_threads, set_kernel_threads

    torch.manual_seed(0)
    w = torch.randn(5, 40, 64).to(w_dtype)
    slots = torch.tensor([0] * 50 + [2] + [4] * 3)
    x = torch.randn(len(slots), 64)
    want = torch.stack([x[i] @ w[s].float().T for i, s in enumerate(slots.tolist())])
    before = kernel_threads()
    set_kernel_threads(num_threads)
    try:
        got = gg.grouped_gemm(x, gg.slot_offsets(slots, 5), w)
    finally:
        set_kernel_threads(before)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_fp32_activations_times_bf16_weights_go_to_the_kernel_where_it_is_faster(isa, monkeypatch):
    """A provider's bf16 weights computed in fp32 run in the kernel in every build (any size: here
    300 rows, past the decode path) instead of being widened for oneDNN at every call, and equal
    the widened product."""
    from elasticmoe.layers import linear as lin

    calls = []
    monkeypatch.setattr(lin, "kernel_linear", lambda x, w: calls.append(x.shape) or gg.kernel_linear(x, w))
    torch.manual_seed(0)
    x, w = torch.randn(300, 64), torch.randn(48, 64).bfloat16()
    got = lin.linear(x, w)
    torch.testing.assert_close(got, x @ w.float().T, atol=1e-5, rtol=1e-5)
    assert gg.computes_fp32_with_bf16_weights() and calls == [(300, 64)]


def test_grouped_gemm_never_reads_slots_without_rows(isa):
    w = torch.randn(4, 8, 32)
    w[1:3] = float("nan")  # stands for unmapped adapter rows
    slots = torch.tensor([0, 0, 3])
    out = gg.grouped_gemm(torch.randn(3, 32), gg.slot_offsets(slots, 4), w)
    assert torch.isfinite(out).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_paged_decode_attention_equals_gathered_attention(isa, dtype):
    torch.manual_seed(0)
    batch, heads, kv_heads, head_dim, block_size = 5, 8, 2, 64, 4
    num_blocks = 40
    cache = torch.randn(num_blocks * block_size, 2, kv_heads, head_dim).to(dtype)
    lens = torch.tensor([1, 3, 9, 17, 30])
    max_blocks = int((lens.max() + block_size - 1) // block_size)
    table = torch.randperm(num_blocks)[: batch * max_blocks].view(batch, max_blocks)
    q = torch.randn(batch, heads + kv_heads, head_dim).to(dtype)[:, :heads]  # a strided view, as in the model
    kv = cache.view(-1, block_size, 2, kv_heads, head_dim).index_select(0, table.reshape(-1))
    kv = kv.view(batch, -1, 2, kv_heads, head_dim)
    k, v = kv[:, :, 0].transpose(1, 2).contiguous(), kv[:, :, 1].transpose(1, 2).contiguous()
    mask = torch.arange(max_blocks * block_size)[None] < lens[:, None]
    want = decode_attention(q, k, v, mask, head_dim**-0.5)
    got = pa.paged_decode_attention(q, cache, table, lens, block_size, head_dim**-0.5)
    assert got is not None
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)


def _causal_reference(q: torch.Tensor, kv: torch.Tensor, scale: float) -> torch.Tensor:
    k, v = (kv[:, :, i].transpose(1, 2).float() for i in (0, 1))
    out = torch.nn.functional.scaled_dot_product_attention(q.transpose(1, 2).float(), k, v, is_causal=True,
                                                           scale=scale, enable_gqa=True)
    return out.transpose(1, 2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("spans", "length", "heads", "kv_heads", "head_dim"),
                         [(3, 1, 8, 2, 64), (2, 17, 8, 2, 64), (5, 40, 4, 4, 32), (1, 130, 8, 1, 128), (2, 33, 16, 2, 64)])
def test_causal_attention_kernel_equals_causal_sdpa(isa, dtype, spans, length, heads, kv_heads, head_dim):
    """Whole spans, q a strided view of a fused projection (as in the model), every GQA group size
    (1, 4, 8 query heads per KV head), lengths around the kernel's query blocks and vectors."""
    torch.manual_seed(0)
    qkv = torch.randn(spans, length, heads + 2 * kv_heads, head_dim).to(dtype)
    q = qkv[:, :, :heads]
    kv = torch.randn(spans, length, 2, kv_heads, head_dim).to(dtype)
    got = ca.causal_attention(q, kv, head_dim**-0.5)
    assert got is not None and got.shape == q.shape and got.dtype == dtype
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), _causal_reference(q, kv, head_dim**-0.5), atol=tol, rtol=tol)


def test_causal_attention_kernel_rounds_bf16_as_the_batched_matmuls_do(isa):
    """bf16: scores, probabilities and outputs rounded where `layers.attention.causal_attention`
    rounds them; only the fp32 summation order may differ (a bf16 ulp on a few values)."""
    from elasticmoe.layers.attention import causal_attention as batched

    torch.manual_seed(0)
    q = torch.randn(4, 48, 8, 64).to(torch.bfloat16)
    kv = torch.randn(4, 48, 2, 2, 64).to(torch.bfloat16)
    got = ca.causal_attention(q, kv, 0.125)
    want = batched(q, kv[:, :, 0].transpose(1, 2).contiguous(), kv[:, :, 1].transpose(1, 2).contiguous(), 0.125)
    assert got is not None
    differ = (got != want).float().mean().item()
    assert differ < 0.02, differ
    torch.testing.assert_close(got.float(), want.float(), atol=8e-3, rtol=8e-3)


def test_causal_attention_kernel_reads_a_padded_chunks_keys_through_their_view(isa):
    """The padded chunk of a chunked prefill hands a view of its gathered blocks cut to the
    context (kv[:, :context]): span and token strides of a longer tensor."""
    torch.manual_seed(0)
    blocks = torch.randn(1, 48, 2, 2, 64)
    kv = blocks[:, :37]
    q = torch.randn(1, 37, 8, 64)
    got = ca.causal_attention(q, kv, 0.125)
    assert got is not None
    torch.testing.assert_close(got, _causal_reference(q, kv.contiguous(), 0.125), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("earlier", "chunk"), [(1, 16), (16, 17), (100, 5), (37, 64), (5000, 70)])
def test_causal_attention_kernel_of_a_chunk_over_earlier_context(isa, dtype, earlier, chunk):
    """Fewer queries than keys: the queries are the context's last ones (query i sees keys up to
    earlier + i), as a chunked prefill's later chunk attends; over 5,000 earlier keys a task takes
    fewer query positions (`query_block`)."""
    torch.manual_seed(0)
    context = earlier + chunk
    q = torch.randn(2, chunk, 8, 64).to(dtype)
    kv = torch.randn(2, context, 2, 2, 64).to(dtype)
    got = ca.causal_attention(q, kv, 0.125)
    assert got is not None and got.shape == q.shape
    k, v = (kv[:, :, i].transpose(1, 2).float() for i in (0, 1))
    mask = torch.arange(context)[None] <= torch.arange(earlier, context)[:, None]
    want = torch.nn.functional.scaled_dot_product_attention(q.transpose(1, 2).float(), k, v, attn_mask=mask,
                                                            scale=0.125, enable_gqa=True).transpose(1, 2)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), want, atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("heads", "kv_heads", "key_dim", "value_dim", "earlier"),
                         [(4, 4, 96, 64, 0), (4, 4, 192, 128, 9), (8, 2, 32, 64, 0), (4, 4, 48, 16, 3)])
def test_causal_attention_kernel_with_keys_and_values_apart(isa, dtype, heads, kv_heads, key_dim, value_dim, earlier):
    """Keys and values of their own widths and strides, as an MLA layer expands them from its
    latents (the values a view of the expansion, heads wider apart than their width)."""
    torch.manual_seed(0)
    spans, chunk = 2, 37
    context = earlier + chunk
    q = torch.randn(spans, chunk, heads, key_dim).to(dtype)
    k = torch.randn(spans, context, kv_heads, key_dim).to(dtype)
    expanded = torch.randn(spans, context, kv_heads, 24 + value_dim).to(dtype)
    v = expanded[..., 24:]  # head stride 24 + value_dim, as `split` leaves it
    got = ca.causal_attention_kv(q, k, v, key_dim**-0.5)
    assert got is not None and got.shape == (spans, chunk, heads, value_dim)
    mask = torch.arange(context)[None] <= torch.arange(earlier, context)[:, None]
    want = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(1, 2).float(), k.transpose(1, 2).float(), v.transpose(1, 2).float(), attn_mask=mask,
        scale=key_dim**-0.5, enable_gqa=True).transpose(1, 2)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), want, atol=tol, rtol=tol)


def test_causal_attention_kernel_declines_what_it_does_not_serve(isa):
    """None (the caller's PyTorch path runs) for a head size off the vector width or over 128,
    fewer keys than queries, mixed dtypes, or a layout with heads not contiguous."""
    q = torch.randn(2, 8, 4, 64)
    kv = torch.randn(2, 8, 2, 2, 64)
    assert ca.causal_attention(torch.randn(2, 8, 4, 12), torch.randn(2, 8, 2, 2, 12), 0.3) is None
    assert ca.causal_attention(torch.randn(1, 8, 4, 256), torch.randn(1, 8, 2, 2, 256), 0.1) is None
    assert ca.causal_attention(q, torch.randn(2, 7, 2, 2, 64), 0.125) is None
    assert ca.causal_attention(q, kv.to(torch.bfloat16), 0.125) is None
    assert ca.causal_attention(torch.randn(2, 4, 8, 64).transpose(1, 2), kv, 0.125) is None  # heads strided
    assert ca.causal_attention(q.to(torch.float16), kv.to(torch.float16), 0.125) is None
    k = torch.randn(2, 8, 2, 64)
    assert ca.causal_attention_kv(q, k, torch.randn(2, 8, 2, 144), 0.125) is None  # values over 128 wide
    assert ca.causal_attention_kv(q, k, torch.randn(2, 8, 3, 64), 0.125) is None  # values of other heads


def test_swiglu_experts_kernel_equals_torch_path(isa, monkeypatch):
    from elasticmoe.layers import experts

    torch.manual_seed(0)
    w13, w2 = torch.randn(8, 64, 48), torch.randn(8, 48, 32)
    x = torch.randn(40, 48)
    slots = torch.randint(0, 8, (40,)).sort().values
    got = experts.grouped_experts_sorted(x, slots, w13, w2)
    monkeypatch.setattr(experts, "has_grouped_gemm", lambda *a: False)
    want = experts.grouped_experts_sorted(x, slots, w13, w2)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize(("x_dtype", "w_dtype"), DTYPES)
def test_fused_rms_norm_equals_torch(isa, monkeypatch, x_dtype, w_dtype):
    from elasticmoe.kernels import rms_norm as rn
    from elasticmoe.layers import norm

    monkeypatch.setattr(rn, "load_kernel", lambda n, _isa=isa: load_kernel(n, _isa))
    rn._library.cache_clear()
    torch.manual_seed(0)
    x = torch.randn(7, 3 * 70).to(x_dtype)[:, :70]  # rows with a stride, a tail past the vector width
    w = torch.randn(70).to(w_dtype)
    got = rn.fused_rms_norm(x, w, 1e-6)
    monkeypatch.setattr(norm, "fused_rms_norm", lambda *a: None)
    want = norm.rms_norm(x, w, 1e-6)
    rn._library.cache_clear()
    assert got is not None and got.dtype == want.dtype
    tol = 1e-6 if x_dtype == torch.float32 else 1e-2
    torch.testing.assert_close(got, want, atol=tol, rtol=tol)
    if x_dtype == torch.bfloat16:  # the same values bar a rare last-bit tie
        assert (got == want).float().mean() > 0.99


@pytest.mark.parametrize(("x_dtype", "w_dtype"), DTYPES)
@pytest.mark.parametrize("num_rows", [3, 700])  # a decode step on the caller's thread; a prefill on all
def test_fused_add_rms_norm_equals_the_add_then_the_fused_norm(isa, monkeypatch, x_dtype, w_dtype, num_rows):
    from elasticmoe.kernels import rms_norm as rn
    from elasticmoe.layers import norm

    monkeypatch.setattr(rn, "load_kernel", lambda n, _isa=isa: load_kernel(n, _isa))
    rn._library.cache_clear()
    torch.manual_seed(0)
    h = torch.randn(num_rows, 2 * 400).to(x_dtype)[:, :400]  # a row stride, a tail past the vector width
    y = torch.randn(num_rows, 400).to(x_dtype) * 3
    w = torch.randn(400).to(w_dtype)
    h_before = h.clone()
    fused = rn.fused_add_rms_norm(h, y, w, 1e-6)
    assert fused is not None
    total, normed = fused
    assert torch.equal(total, h + y)  # rounded to the dtype as PyTorch's add rounds
    assert torch.equal(normed, rn.fused_rms_norm(h + y, w, 1e-6))  # the norm of the rounded sum
    assert torch.equal(h, h_before)  # the residual stream it was given is left as it was
    with monkeypatch.context() as m:
        m.setattr(norm, "fused_add_rms_norm", lambda *a: None)
        unfused = norm.add_rms_norm(h, y, w, 1e-6)
    rn._library.cache_clear()
    assert torch.equal(unfused[0], total) and unfused[1].shape == normed.shape


def test_threads_are_pinned_only_to_this_process_cpus_and_the_caller_only_per_step():
    import os

    from elasticmoe.kernels.build import bind_threads, pinned_to

    cpus = sorted(os.sched_getaffinity(0))
    assert bind_threads(len(cpus) + 1) is None  # more threads than CPUs: left to the scheduler
    before = os.sched_getaffinity(0)
    if len(cpus) >= 2:
        assert bind_threads(len(cpus)) in (cpus, None)
    assert os.sched_getaffinity(0) == before  # the caller itself stays free between steps
    with pinned_to(cpus[0]):
        assert os.sched_getaffinity(0) == {cpus[0]}
    assert os.sched_getaffinity(0) == before


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_rms_norm_over_heads_of_a_fused_projection(isa, monkeypatch, dtype):
    from elasticmoe.kernels import rms_norm as rn

    monkeypatch.setattr(rn, "load_kernel", lambda n, _isa=isa: load_kernel(n, _isa))
    rn._library.cache_clear()
    torch.manual_seed(0)
    qkv = torch.randn(5, 8 + 2 * 2, 64).to(dtype)  # [T, H + 2 Hkv, D], as the qkv projection's view
    w = torch.randn(64).to(dtype)
    out = torch.empty(5, 8 + 2, 64, dtype=dtype)
    assert rn.fused_rms_norm(qkv[:, 8:10], w, 1e-6, out[:, 8:]) is not None  # the k heads
    xf = qkv[:, 8:10].float()
    want = w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6)).to(dtype)
    rn._library.cache_clear()
    tol = 1e-6 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(out[:, 8:], want, atol=tol, rtol=tol)


@pytest.mark.parametrize("renormalize", [False, True])
@pytest.mark.parametrize("num_tokens", [50, 2000])  # a decode step; a prefill, on all threads
def test_topk_equals_torch_topk(isa, renormalize, num_tokens):
    torch.manual_seed(0)
    probs = torch.softmax(torch.randn(num_tokens, 12), dim=-1)
    weights, ids = mr.topk_probs(probs, 4, renormalize)
    want_w, want_ids = torch.topk(probs, 4, dim=-1)
    if renormalize:
        want_w = want_w / want_w.sum(dim=-1, keepdim=True)
    assert torch.equal(ids, want_ids)
    torch.testing.assert_close(weights, want_w, atol=1e-7, rtol=1e-6)
    ties = torch.tensor([[0.25, 0.25, 0.5, 0.0, 0.25]])  # equal values: lower expert id first
    assert mr.topk_probs(ties, 3, False)[1].tolist() == [[2, 0, 1]]
    assert mr.topk_probs(probs, 13, False) is None and mr.topk_probs(probs.double(), 2, False) is None


def test_pair_plan_is_a_stable_sort_by_slot(isa):
    torch.manual_seed(0)
    num_tokens, top_k, num_experts = 37, 3, 9
    ids = torch.stack([torch.randperm(num_experts)[:top_k] for _ in range(num_tokens)])
    expert_to_slot = torch.randperm(num_experts)
    plan = mr.plan_pairs(ids, expert_to_slot, num_experts)
    pair_slots = expert_to_slot[ids.reshape(-1)]
    order = torch.argsort(pair_slots, stable=True)
    assert torch.equal(plan.pair_of_row, order)
    assert torch.equal(plan.token_of_row, order // top_k)
    assert torch.equal(plan.slot_of_row, pair_slots[order])
    assert torch.equal(plan.row_of_pair[order], torch.arange(order.numel()))
    assert torch.equal(plan.offsets, gg.slot_offsets(pair_slots[order], num_experts))
    with pytest.raises(ValueError, match="out of range"):
        mr.plan_pairs(torch.tensor([[0, num_experts]]), expert_to_slot, num_experts)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_tokens", [3, 700])  # a decode step's few tokens; a prefill's, in parallel
def test_combine_equals_index_add_of_weighted_rows(isa, dtype, num_tokens):
    torch.manual_seed(0)
    top_k, hidden = 4, 40  # a tail past the vector width
    row_of_pair = torch.randperm(num_tokens * top_k)
    pair_out = torch.randn(num_tokens * top_k, hidden).to(dtype)
    weights = torch.rand(num_tokens, top_k).to(dtype)
    got = mr.combine_pairs(pair_out, row_of_pair, weights)
    rows = pair_out.float()[row_of_pair].view(num_tokens, top_k, hidden)
    want = (rows * weights.float().unsqueeze(-1)).sum(1)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert got.dtype == dtype
    torch.testing.assert_close(got.float(), want, atol=tol, rtol=tol)
