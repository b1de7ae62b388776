"""Weight memory and KV capacity of a base model + N ESFT adapters (ExpertWeave §3.1, §5.4). Pure.

Three ways to hold the weights, for `M` base experts, adapters with `e_i^(l)` tuned
experts in MoE layer `l` and a per-slot cap `E_max`:

- ours (virtual weight tensor on the HMM): each stacked expert tensor (`w13`, `w2` of a
  layer) is *virtually* `[M + N * E_max, ...]`, but physical pages are mapped only for
  the `M` base rows and adapter `i`'s `e_i^(l)` rows (from `M + i * E_max`); rows are
  packed back to back, so a page straddling two mapped rows is mapped once (the HMM's
  sub-page sharing, `hmm.memory.page_table`; the rule is restated here because the core
  does not import `hmm`). NOTE: the elastic server maps expert rows page-aligned (so
  they can be remapped); for rows of whole pages, as in the small model, both agree;
- padding: the same tensors allocated whole, `M + N * E_max` rows each, on the same
  pages (so ours never exceeds padding: its pages are a subset);
- merged: N full models, each the base with one adapter's experts swapped in.

needed = dense + sum_l (M + sum_i e_i^(l)) * row bytes. `F_mem = allocated / needed`
over the routed-expert tensors only, as in §3.1 (dense weights are identical in every
scheme); the padding value equals the paper's `L (M + N E_max) / sum_l (M + sum_i e_i^(l))`
when rows are whole pages (the small model's are) and all layers have the same row size.

KV capacity = max(0, budget - weights) // KV bytes per token: what is left of a device
once the weights are in, as in Fig. 9.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from elasticmoe.config import ModelConfig
from elasticmoe.engine.kv_cache import KVCacheSpec
from elasticmoe.models.registry import model_family

DEVICE_PAGE_SIZE = 64 * 1024  # the HMM's device page (hmm.device_memory.DEVICE_PAGE_SIZE)
_STACK = re.compile(r"^layers\.(\d+)\.")


@dataclass(frozen=True, slots=True)
class ModelSizes:
    """Bytes of a model's dense tensors and of one expert row of each stacked expert tensor
    (`expert_stacks`: (name, layer, row bytes)); like `hmm.layout.ModelSizes`."""

    num_experts: int
    dense: tuple[tuple[str, int], ...]
    expert_stacks: tuple[tuple[str, int, int], ...]

    @classmethod
    def from_model(cls, cfg: ModelConfig, dtype_bytes: int) -> ModelSizes:
        dense, stacks = [], []
        for spec in model_family(cfg.arch).param_specs(cfg, tuple(range(cfg.num_experts))):
            if spec.is_stacked:
                m = _STACK.match(spec.name)
                assert m is not None
                stacks.append((spec.name, int(m.group(1)), math.prod(spec.shape[1:]) * dtype_bytes))
            else:
                dense.append((spec.name, math.prod(spec.shape) * dtype_bytes))
        return cls(cfg.num_experts, tuple(dense), tuple(stacks))

    @property
    def dense_bytes(self) -> int:
        return sum(b for _, b in self.dense)


def _pages_of_rows(rows: Sequence[int], row_bytes: int, page_size: int) -> int:
    """Pages mapped when exactly `rows` of a packed stack are mapped (a shared page counts once)."""
    pages: set[int] = set()
    for r in rows:
        first, last = r * row_bytes // page_size, ((r + 1) * row_bytes - 1) // page_size
        pages.update(range(first, last + 1))
    return len(pages)

# layer -> tuned expert ids (an adapter's `EsftConfig.experts`)
AdapterExperts = Mapping[int, Sequence[int]]

__all__ = ["DEVICE_PAGE_SIZE", "AdapterExperts", "ModelSizes", "WeightMemory", "kv_bytes_per_token",
           "kv_capacity_tokens", "weight_memory"]


@dataclass(frozen=True, slots=True)
class WeightMemory:
    """Bytes of the weights for one set of adapters under the three schemes (see the module doc)."""

    num_adapters: int
    e_max: int
    page_size: int
    dense_bytes: int
    base_expert_bytes: int  # M rows of every expert tensor
    needed_expert_bytes: int  # base + every tuned expert, exactly
    ours_expert_bytes: int  # mapped pages * page size
    padding_expert_bytes: int  # M + N * E_max rows of every expert tensor, in whole pages

    @property
    def base_bytes(self) -> int:
        return self.dense_bytes + self.base_expert_bytes

    @property
    def needed_bytes(self) -> int:
        return self.dense_bytes + self.needed_expert_bytes

    @property
    def ours_bytes(self) -> int:
        return self.dense_bytes + self.ours_expert_bytes

    @property
    def padding_bytes(self) -> int:
        return self.dense_bytes + self.padding_expert_bytes

    @property
    def merged_bytes(self) -> int:
        return self.num_adapters * self.base_bytes

    @property
    def fmem_ours(self) -> float:
        return self.ours_expert_bytes / self.needed_expert_bytes

    @property
    def fmem_padding(self) -> float:
        return self.padding_expert_bytes / self.needed_expert_bytes


def weight_memory(
    sizes: ModelSizes, adapters: Sequence[AdapterExperts], e_max: int, page_size: int = DEVICE_PAGE_SIZE
) -> WeightMemory:
    """Weight bytes of the base model `sizes` serving `adapters` (slot i = adapters[i])."""
    m, n = sizes.num_experts, len(adapters)
    if n < 1:
        raise ValueError("weight memory: need at least one adapter")
    for i, experts in enumerate(adapters):
        for layer, ids in experts.items():
            if len(ids) > e_max:
                raise ValueError(f"adapter {i} layer {layer}: {len(ids)} experts > E_max {e_max}")
            if any(not 0 <= e < m for e in ids):
                raise ValueError(f"adapter {i} layer {layer}: expert ids {list(ids)} outside [0, {m})")
    stack_layers = {layer for _, layer, _ in sizes.expert_stacks}
    stray = {layer for experts in adapters for layer in experts} - stack_layers
    if stray:
        raise ValueError(f"weight memory: adapters tune layers {sorted(stray)} that have no routed experts")
    base = needed = ours = padding = 0
    for _, layer, row_bytes in sizes.expert_stacks:
        counts = [len(experts.get(layer, ())) for experts in adapters]
        base += m * row_bytes
        needed += (m + sum(counts)) * row_bytes
        padding += -(-(m + n * e_max) * row_bytes // page_size) * page_size
        rows = list(range(m))
        for i, count in enumerate(counts):
            rows += range(m + i * e_max, m + i * e_max + count)
        ours += _pages_of_rows(rows, row_bytes, page_size) * page_size
    return WeightMemory(n, e_max, page_size, sizes.dense_bytes, base, needed, ours, padding)


def kv_bytes_per_token(spec: KVCacheSpec) -> int:
    """KV bytes one token occupies across all layers."""
    return spec.bytes_per_block // spec.block_size


def kv_capacity_tokens(budget_bytes: int, weight_bytes: int, bytes_per_token: int) -> int:
    """Tokens of KV cache that fit next to `weight_bytes` of weights; 0 when the weights do not fit."""
    if bytes_per_token <= 0:
        raise ValueError(f"kv capacity: bytes_per_token must be > 0, got {bytes_per_token}")
    return max(0, budget_bytes - weight_bytes) // bytes_per_token
