"""The ESFT benchmark's pure parts: weight memory / F_mem / KV capacity arithmetic and the
power-law workload (shares, seeding)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from elasticmoe.bench.esft_memory import ModelSizes, kv_bytes_per_token, kv_capacity_tokens, weight_memory
from elasticmoe.bench.workload import make_workload, power_law_shares
from elasticmoe.engine.kv_cache import KVCacheSpec


def make_sizes(w2: bool = True) -> ModelSizes:
    """4 experts, 2 MoE layers; w13 rows of 64 B, w2 rows of 32 B; 1000 B of dense weights."""
    stacks = [("layers.0.moe.w13", 0, 64), ("layers.1.moe.w13", 1, 64)]
    if w2:
        stacks += [("layers.0.moe.w2", 0, 32), ("layers.1.moe.w2", 1, 32)]
    return ModelSizes(num_experts=4, dense=(("embed", 1000),), expert_stacks=tuple(stacks))


ADAPTERS = [{0: (1, 2), 1: (3,)}, {0: (0,)}]  # N = 2, E_max = 2


def test_weight_memory_by_hand():
    mem = weight_memory(make_sizes(), ADAPTERS, e_max=2, page_size=64)
    # Per tensor, 4 + 2*2 = 8 rows. Mapped rows: layer 0 -> base 0..3, slot 0 rows 4,5, slot 1 row 6;
    # layer 1 -> base 0..3, slot 0 row 4. w13 rows are one page each; two w2 rows share a page.
    assert mem.base_expert_bytes == 2 * 4 * (64 + 32)
    assert mem.needed_expert_bytes == (4 + 3) * 96 + (4 + 1) * 96
    assert mem.ours_expert_bytes == 7 * 64 + 4 * 64 + 5 * 64 + 3 * 64  # w13 l0, w2 l0, w13 l1, w2 l1
    assert mem.padding_expert_bytes == 2 * (8 * 64 + 4 * 64)
    assert mem.needed_bytes == 1000 + mem.needed_expert_bytes
    assert mem.ours_bytes == 1000 + 1216 and mem.padding_bytes == 1000 + 1536
    assert mem.merged_bytes == 2 * (1000 + 768)
    assert mem.fmem_ours == pytest.approx(1216 / 1152)
    assert mem.fmem_padding == pytest.approx(1536 / 1152)
    assert 1 <= mem.fmem_ours <= mem.fmem_padding


def test_fmem_padding_is_the_papers_formula_when_rows_are_whole_pages():
    mem = weight_memory(make_sizes(w2=False), ADAPTERS, e_max=2, page_size=64)
    # L (M + N E_max) / sum_l (M + sum_i e_i^(l))
    assert mem.fmem_padding == pytest.approx(2 * (4 + 2 * 2) / ((4 + 3) + (4 + 1)))
    assert mem.fmem_ours == pytest.approx(1.0)  # no page is shared, so nothing is wasted


def test_pages_shared_by_rows_are_counted_once_and_ours_never_exceeds_padding():
    # Rows of 64 B on 4 KiB pages: everything lands on one page per tensor.
    mem = weight_memory(make_sizes(), ADAPTERS, e_max=2, page_size=4096)
    assert mem.ours_expert_bytes == mem.padding_expert_bytes == 4 * 4096
    for page in (16, 48, 64, 96, 100):
        m = weight_memory(make_sizes(), ADAPTERS, e_max=3, page_size=page)
        assert m.needed_expert_bytes <= m.ours_expert_bytes <= m.padding_expert_bytes


def test_weight_memory_rejects_bad_adapters():
    with pytest.raises(ValueError, match="E_max"):
        weight_memory(make_sizes(), ADAPTERS, e_max=1)
    with pytest.raises(ValueError, match="outside"):
        weight_memory(make_sizes(), [{0: (4,)}], e_max=2)
    with pytest.raises(ValueError, match="no routed experts"):
        weight_memory(make_sizes(), [{5: (0,)}], e_max=2)
    with pytest.raises(ValueError, match="at least one"):
        weight_memory(make_sizes(), [], e_max=2)


def test_kv_capacity():
    spec = KVCacheSpec(num_layers=2, block_size=16, token_shape=(2, 2, 16), dtype=torch.bfloat16)
    assert kv_bytes_per_token(spec) == 2 * 2 * 2 * 16 * 2
    assert kv_capacity_tokens(1000, 488, 256) == 2
    assert kv_capacity_tokens(1000, 1000, 256) == 0
    assert kv_capacity_tokens(1000, 5000, 256) == 0  # the weights alone do not fit
    with pytest.raises(ValueError):
        kv_capacity_tokens(1000, 0, 0)


def test_power_law_shares_shape():
    for n in (1, 2, 5, 20):
        for alpha in (1.0, 0.3, 0.1):
            shares = power_law_shares(n, alpha)
            assert len(shares) == n and sum(shares) == pytest.approx(1.0)
            assert all(a >= b - 1e-12 for a, b in zip(shares, shares[1:], strict=False))
    assert power_law_shares(4, 1.0) == pytest.approx([0.25] * 4)
    # §5.2: two adapters at alpha = 0.32 split about 80/20.
    assert power_law_shares(2, 0.32)[0] == pytest.approx(0.80, abs=0.005)
    assert power_law_shares(20, 0.1)[0] > power_law_shares(20, 0.3)[0] > power_law_shares(20, 1.0)[0]
    with pytest.raises(ValueError):
        power_law_shares(3, 0.0)


def test_power_law_shares_match_s_loras_sampler():
    # S-LoRA draws adapter ids as floor(N * numpy.random.power(alpha)).
    rng = np.random.default_rng(0)
    n, alpha = 10, 0.3
    ids = np.minimum((rng.power(alpha, 200_000) * n).astype(int), n - 1)
    freq = np.bincount(ids, minlength=n) / len(ids)
    assert freq == pytest.approx(power_law_shares(n, alpha), abs=0.005)


def test_workload_seeding_and_poisson_arrivals():
    shares = power_law_shares(5, 0.3)
    a = make_workload(2000, 4.0, shares, input_len=3, vocab_size=100, seed=7)
    assert a == make_workload(2000, 4.0, shares, input_len=3, vocab_size=100, seed=7)
    assert a != make_workload(2000, 4.0, shares, input_len=3, vocab_size=100, seed=8)
    # Arrivals and prompts do not depend on the adapter shares; only the choices do.
    u = make_workload(2000, 4.0, power_law_shares(5, 1.0), input_len=3, vocab_size=100, seed=7)
    assert [(r.arrival_s, r.prompt_token_ids) for r in a] == [(r.arrival_s, r.prompt_token_ids) for r in u]
    assert a[0].arrival_s == 0.0 and all(x.arrival_s <= y.arrival_s for x, y in zip(a, a[1:], strict=False))
    assert a[-1].arrival_s / (len(a) - 1) == pytest.approx(1 / 4.0, rel=0.1)  # mean gap 1 / rps
    assert all(len(r.prompt_token_ids) == 3 and min(r.prompt_token_ids) >= 3 for r in a)
    freq = np.bincount([r.adapter_index for r in a], minlength=5) / len(a)
    assert freq == pytest.approx(shares, abs=0.04)
