"""ESFT adapter memory fragmentation factor F_mem (ExpertWeave §3.1).

With `M` base experts, `N` adapters, `L` MoE layers and `e_i^(l)` fine-tuned
experts of adapter `i` in layer `l`, the padding approach allocates
`[M + N * E_max]` experts per layer while `M + sum_i e_i^(l)` are needed:

    F_mem = L * (M + N * E_max) / sum_l (M + sum_i e_i^(l))

(the paper's 10 adapters, E_max = 13, M = 64, L = 26 give 1.51, which fixes that
M is in both numerator and denominator). For the virtual weight tensor the same
ratio is "allocated / needed" with allocated = pages actually mapped: per layer
the base slots and each adapter's `e_i^(l)` slots of the `[M + N * E_max]` packed
layout, sharing straddling pages (`page_table.pages_needed`).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from hmm.memory.page_table import SlotLayout, pages_needed


@dataclass(frozen=True, slots=True)
class ExpertShape:
    """An MoE model's routed-expert geometry (one expert = gate + up + down)."""

    num_experts: int
    hidden_size: int
    moe_intermediate_size: int
    dtype_bytes: int = 2

    @property
    def expert_bytes(self) -> int:
        return 3 * self.hidden_size * self.moe_intermediate_size * self.dtype_bytes


DEEPSEEK_V2_LITE = ExpertShape(num_experts=64, hidden_size=2048, moe_intermediate_size=1408, dtype_bytes=2)


@dataclass(frozen=True, slots=True)
class EsftConfig:
    """One ESFT adapter: the fine-tuned expert ids of each MoE layer."""

    name: str
    experts: dict[int, tuple[int, ...]]

    def count(self, layer: int) -> int:
        return len(self.experts.get(layer, ()))

    @property
    def max_experts(self) -> int:
        return max((len(e) for e in self.experts.values()), default=0)


def load_esft_config(path: str | Path) -> EsftConfig:
    """Read an ESFT `expert_config.json` (`{"experts": {"<layer>": [ids]}, ...}`)."""
    raw = json.loads(Path(path).read_text())
    experts = {int(layer): tuple(int(e) for e in ids) for layer, ids in raw["experts"].items()}
    return EsftConfig(Path(path).stem, experts)


def load_esft_configs(directory: str | Path) -> list[EsftConfig]:
    return [load_esft_config(p) for p in sorted(Path(directory).glob("*.json"))]


def moe_layers(configs: Sequence[EsftConfig]) -> list[int]:
    """Layers any adapter fine-tunes (for DeepSeek-V2-Lite: 1..26, layer 0 is dense)."""
    return sorted({layer for c in configs for layer in c.experts})


def smallest_e_max(configs: Sequence[EsftConfig]) -> int:
    return max(c.max_experts for c in configs)


def adapter_sparsity(config: EsftConfig, layers: Sequence[int]) -> float:
    """ExpertWeave's S_i = sum_l (E_i - e_i^(l)) / (L * E_i) (Table 1)."""
    e_i = config.max_experts
    return sum(e_i - config.count(layer) for layer in layers) / (len(layers) * e_i)


def adapter_slot_ids(configs: Sequence[EsftConfig], layer: int, num_base: int, e_max: int) -> list[list[int]]:
    """Slots of each adapter in layer `layer` of the `[M + N * E_max]` tensor:
    adapter `i` uses `[M + i * E_max, M + i * E_max + e_i^(l))`."""
    out: list[list[int]] = []
    for i, c in enumerate(configs):
        if c.count(layer) > e_max:
            raise ValueError(f"{c.name} layer {layer}: {c.count(layer)} experts > E_max {e_max}")
        start = num_base + i * e_max
        out.append(list(range(start, start + c.count(layer))))
    return out


def fmem_padding(configs: Sequence[EsftConfig], num_base: int, e_max: int | None = None) -> float:
    """F_mem of the padding approach (ExpertWeave §3.1, exactly)."""
    layers = moe_layers(configs)
    e_max = smallest_e_max(configs) if e_max is None else e_max
    needed = sum(num_base + sum(c.count(layer) for c in configs) for layer in layers)
    return len(layers) * (num_base + len(configs) * e_max) / needed


def vpage_mapped_pages(
    configs: Sequence[EsftConfig], num_base: int, expert_bytes: int, page_size: int, e_max: int | None = None
) -> int:
    """Pages the virtual weight tensors map for base + all adapters, over all layers."""
    e_max = smallest_e_max(configs) if e_max is None else e_max
    layout = SlotLayout(num_base + len(configs) * e_max, expert_bytes, page_size)
    total = 0
    for layer in moe_layers(configs):
        slot_ids = list(range(num_base))
        for ids in adapter_slot_ids(configs, layer, num_base, e_max):
            slot_ids += ids
        total += pages_needed(layout, slot_ids)
    return total


def fmem_vpage(
    configs: Sequence[EsftConfig], num_base: int, expert_bytes: int, page_size: int, e_max: int | None = None
) -> float:
    """F_mem of the virtual weight tensor: mapped page bytes / needed expert bytes."""
    layers = moe_layers(configs)
    needed = sum(num_base + sum(c.count(layer) for c in configs) for layer in layers) * expert_bytes
    return vpage_mapped_pages(configs, num_base, expert_bytes, page_size, e_max) * page_size / needed
