"""ESFT memory fragmentation factor F_mem (ExpertWeave §3.1): padding vs vpage."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hmm.memory.fragmentation import (
    DEEPSEEK_V2_LITE,
    EsftConfig,
    adapter_sparsity,
    fmem_padding,
    fmem_vpage,
    load_esft_configs,
    moe_layers,
    smallest_e_max,
    vpage_mapped_pages,
)

ESFT_DIR = Path("/work/shared/data/esft_expert_configs")
MiB = 1024 * 1024


def test_fmem_padding_hand_computed():
    # M = 4, N = 2, L = 2; counts: a = (3, 1), b = (2, 0) -> E_max = 3
    a = EsftConfig("a", {1: (0, 1, 2), 2: (3,)})
    b = EsftConfig("b", {1: (0, 1)})
    assert smallest_e_max([a, b]) == 3 and moe_layers([a, b]) == [1, 2]
    # allocated 2 * (4 + 2 * 3) = 20 experts, needed (4 + 5) + (4 + 1) = 14
    assert fmem_padding([a, b], num_base=4) == pytest.approx(20 / 14)
    assert fmem_padding([a, b], num_base=4, e_max=5) == pytest.approx(2 * 14 / 14)
    assert adapter_sparsity(a, [1, 2]) == pytest.approx((0 + 2) / (2 * 3))


def test_fmem_matches_paper_table1_order_of_magnitude():
    # Table 1 averages for the paper's 10 adapters, E_max = 13, M = 64, L = 26: paper says 1.51
    averages = [7.04, 6.12, 9.50, 7.12, 7.73, 5.15, 7.35, 6.58, 4.69, 3.85]
    assert (64 + 10 * 13) / (64 + sum(averages)) == pytest.approx(1.51, abs=0.01)


def test_fmem_real_esft_configs_padding_vs_vpage():
    configs = load_esft_configs(ESFT_DIR)
    layers = moe_layers(configs)
    assert layers == list(range(1, 27)) and smallest_e_max(configs) == 9
    raw = [json.loads(p.read_text())["experts"] for p in sorted(ESFT_DIR.glob("*.json"))]
    total_adapter_experts = sum(len(ids) for cfg in raw for ids in cfg.values())
    expected = 26 * (64 + 4 * 9) / (26 * 64 + total_adapter_experts)
    padding = fmem_padding(configs, DEEPSEEK_V2_LITE.num_experts)
    assert padding == pytest.approx(expected) and padding > 1.15

    expert = DEEPSEEK_V2_LITE.expert_bytes
    assert expert == 3 * 2048 * 1408 * 2
    vpage_2m = fmem_vpage(configs, 64, expert, 2 * MiB)
    assert 1.0 <= vpage_2m < 1.01  # partial pages only at the ends of each adapter run
    assert fmem_vpage(configs, 64, expert, MiB // 2) == 1.0  # 512 KiB divides an expert (33 pages)
    # the same tensors with every adapter padded to E_max in physical pages
    padded_pages = 26 * -(-(64 + 4 * 9) * expert // (2 * MiB))
    assert vpage_mapped_pages(configs, 64, expert, 2 * MiB) < padded_pages


def test_vpage_never_below_one():
    configs = load_esft_configs(ESFT_DIR)
    for page in (4096, 64 * 1024, 2 * MiB, 32 * MiB):
        assert fmem_vpage(configs, 64, DEEPSEEK_V2_LITE.expert_bytes, page) >= 1.0
