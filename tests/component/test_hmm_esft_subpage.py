"""The four real ESFT adapters loaded into real virtual weight tensors (one per
MoE layer, `[M + N * E_max]` slots, ExpertWeave §4.2) at a scaled-down size that
keeps DeepSeek-V2-Lite's 8.25 pages per expert: exactly the needed pages are
mapped (the budget has no page to spare), shared partial pages keep neighbours
intact, and unloading returns every page."""

from __future__ import annotations

import torch

from hmm.memory import MemoryAccount, PagePool, SlotLayout, VirtualTensor, pages_needed
from hmm.memory.fragmentation import adapter_slot_ids, load_esft_configs, moe_layers, smallest_e_max

ESFT_DIR = "/work/shared/data/esft_expert_configs"
PAGE = 4096
EXPERT_SHAPE = (3, 32, 88)  # float32: 33792 bytes = 8.25 pages, like 3*2048*1408*2 on 2 MiB pages
M = 64


def _value(adapter: int, expert: int) -> float:
    return float(expert if adapter < 0 else 1000 + 100 * adapter + expert)


def _check_slots(vt: VirtualTensor, values: dict[int, float]) -> None:
    for slot, value in values.items():
        assert bool((vt.tensor[slot] == value).all()), f"slot {slot} corrupted"


def test_esft_adapters_map_exactly_needed_pages(shm_prefix):
    configs = load_esft_configs(ESFT_DIR)
    layers, n, e_max = moe_layers(configs), len(configs), smallest_e_max(configs)
    expert_bytes = 3 * 32 * 88 * 4
    layout = SlotLayout(M + n * e_max, expert_bytes, PAGE)
    assert expert_bytes * 4 == 33 * PAGE and layout.offset_in_page(1) == PAGE // 4

    slots = {layer: [list(range(M))] + adapter_slot_ids(configs, layer, M, e_max) for layer in layers}
    needed = {layer: pages_needed(layout, [s for ids in slots[layer] for s in ids]) for layer in layers}
    budget = sum(needed.values()) * PAGE  # not one page for padding
    pool = PagePool(MemoryAccount("d0", budget), page_size=PAGE, prefix=shm_prefix)
    vts: dict[int, VirtualTensor] = {}
    values: dict[int, dict[int, float]] = {}
    try:
        for layer in layers:
            vt = vts[layer] = VirtualTensor(pool, layout.num_slots, EXPERT_SHAPE, torch.float32)
            values[layer] = {}
            for adapter, ids in enumerate(slots[layer], start=-1):  # -1: the base experts
                experts = range(M) if adapter < 0 else configs[adapter].experts[layer]
                for slot, expert in zip(ids, experts, strict=True):
                    vt.map_slot(slot)
                    vt.tensor[slot].fill_(_value(adapter, expert))
                    values[layer][slot] = _value(adapter, expert)
            assert vt.num_mapped_pages == needed[layer]
            vt.check_integrity()
        assert pool.num_used * PAGE == pool.account.used == budget and pool.num_free == 0
        for layer in layers:
            _check_slots(vts[layer], values[layer])  # shared partial pages did not clobber neighbours

        # ESFT expert map for one layer: the contiguous tensor serves as the GMM operand
        layer = layers[0]
        for i, cfg in enumerate(configs):
            expert_map = list(range(M))
            for delta, j in enumerate(cfg.experts[layer]):
                expert_map[j] = M + i * e_max + delta
            gathered = vts[layer].tensor.index_select(0, torch.tensor(expert_map))
            want = [_value(i, j) if j in cfg.experts[layer] else float(j) for j in range(M)]
            assert gathered[:, 0, 0, 0].tolist() == want

        # unload "law" (adapter 1) everywhere: its neighbours keep their shared pages and data
        for layer in layers:
            for slot in slots[layer][2]:
                vts[layer].unmap_slot(slot)
                del values[layer][slot]
            remaining = [s for k, ids in enumerate(slots[layer]) if k != 2 for s in ids]
            assert vts[layer].num_mapped_pages == pages_needed(layout, remaining)
            _check_slots(vts[layer], values[layer])
        for layer in layers:
            vts[layer].close()
        assert pool.num_used == 0 and pool.account.used == 0
        pool.check_integrity()
    finally:
        for vt in vts.values():
            vt.close()
        pool.close()
