"""Where an offloaded expert's weights are read from when the expert cache loads it.

Two tiers below the cache (DESIGN.md "Memory tiers"):
- `DiskExperts`: the checkpoint's safetensors, read through mmap (the OS page cache keeps
  recently read experts in host memory for free). The engine's own process holds nothing
  else of the routed experts: this is the tier that lets a model larger than the budget run.
- `HostExperts`: full expert stacks some other owner already keeps in host memory (the HMM's
  shared memory, one copy per node, handed to the engine through a `WeightProvider`); a load
  is one memory copy.

Both copy one expert into one row of the cache's pool tensors and report the bytes copied, and
both describe that copy as raw segments (`segments`) for the native copy thread that runs the
prefetches (`elasticmoe.engine.expert_copier`). The forward thread and the copy thread may read one
source at once; neither writes it, so it holds no lock.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from elasticmoe.kernels.copy_engine import BF16_TO_F32, MEMCPY
from elasticmoe.models.weights import ParamSpec, SafetensorsWeightProvider

# (source address, pool: 0 = w13 / 1 = w2, byte offset in the pool row, count, kind): one piece of an
# expert's copy in the native copy engine's terms (`elasticmoe.kernels.copy_engine`)
Segment = tuple[int, int, int, int, int]


class ExpertSource(Protocol):
    tier: str  # "disk" or "host": the label of the bytes it loads in the metrics

    def copy_into(self, layer: int, local: int, w13: torch.Tensor, w2: torch.Tensor) -> int:
        """Write MoE layer `layer`'s expert of local index `local` into the rows `w13` [2I, H] and
        `w2` [H, I]; returns the bytes written."""
        ...

    def segments(self, layer: int, local: int, dtype: torch.dtype) -> list[Segment] | None:
        """The same copy into pool rows of `dtype` as raw segments, or None where the native engine
        cannot make it (a conversion it does not have): the expert is then copied by `copy_into`."""
        ...


def tensor_segment(src: torch.Tensor, pool: int, offset: int, dtype: torch.dtype) -> Segment | None:
    """`src` (contiguous) written at byte `offset` of a pool row of `dtype`; None: no native kind."""
    if not src.is_contiguous():
        return None
    if src.dtype == dtype:
        return (src.data_ptr(), pool, offset, src.numel() * src.element_size(), MEMCPY)
    if src.dtype == torch.bfloat16 and dtype == torch.float32:
        return (src.data_ptr(), pool, offset, src.numel(), BF16_TO_F32)
    return None


def row_segments(parts_per_pool: Sequence[Sequence[torch.Tensor]], dtype: torch.dtype) -> list[Segment] | None:
    """Segments of one expert whose pool row `pool` is the concatenation (dim 0) of `parts_per_pool[pool]`."""
    out: list[Segment] = []
    for pool, parts in enumerate(parts_per_pool):
        offset = 0
        for part in parts:
            segment = tensor_segment(part, pool, offset, dtype)
            if segment is None:
                return None
            out.append(segment)
            offset += part.numel() * dtype.itemsize
    return out


@dataclass(frozen=True, slots=True)
class LayerExpertSpecs:
    """One MoE layer's two expert stacks: row i of each is built from `sources[i]`."""

    w13: ParamSpec
    w2: ParamSpec


class DiskExperts:
    """Experts read from the checkpoint on demand, one row at a time.

    Every expert's checkpoint tensors are mapped views made once (`SafetensorsWeightProvider.
    mapped_view`), and a row is filled by one `torch._foreach_copy_` call: the prefetch thread runs
    beside the forward, and each Python step it takes holds the GIL the forward needs after every
    op (a thread busy in Python beside the forward made a decode step ~4x slower here; a thread
    copying, 1.4x)."""

    tier = "disk"

    def __init__(self, model_dir: str, layers: Sequence[LayerExpertSpecs]) -> None:
        self.layers = list(layers)
        self.reader = SafetensorsWeightProvider(model_dir)
        # Map every file now: the two threads that read must not race to open one.
        self._views = [(self._sources(spec.w13), self._sources(spec.w2)) for spec in self.layers]

    def _sources(self, spec: ParamSpec) -> list[list[torch.Tensor]]:
        """Per local expert, the checkpoint tensors its row is concatenated from (dim 0)."""
        views = [[self.reader.mapped_view(name) for name in group] for group in spec.sources]
        for group, parts in zip(spec.sources, views, strict=True):
            if sum(p.shape[0] for p in parts) != spec.shape[1] or any(p.shape[1:] != spec.shape[2:] for p in parts):
                raise ValueError(f"checkpoint tensors {group} do not make a {list(spec.shape[1:])} expert row")
        return views

    def copy_into(self, layer: int, local: int, w13: torch.Tensor, w2: torch.Tensor) -> int:
        dsts: list[torch.Tensor] = []
        srcs: list[torch.Tensor] = []
        for dst, parts in ((w13, self._views[layer][0][local]), (w2, self._views[layer][1][local])):
            dsts += [dst] if len(parts) == 1 else dst.split([p.shape[0] for p in parts])
            srcs += parts
        torch._foreach_copy_(dsts, srcs)  # one call, outside the GIL; converts the dtype if needed
        return w13.nbytes + w2.nbytes

    def segments(self, layer: int, local: int, dtype: torch.dtype) -> list[Segment] | None:
        return row_segments((self._views[layer][0][local], self._views[layer][1][local]), dtype)


class HostExperts:
    """Experts copied from full stacks kept in host memory by their owner."""

    tier = "host"

    def __init__(self, stacks: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> None:
        self.stacks = list(stacks)  # per MoE layer: (w13 [E_local, 2I, H], w2 [E_local, H, I])

    def copy_into(self, layer: int, local: int, w13: torch.Tensor, w2: torch.Tensor) -> int:
        src13, src2 = self.stacks[layer]
        w13.copy_(src13[local])
        w2.copy_(src2[local])
        return w13.nbytes + w2.nbytes

    def segments(self, layer: int, local: int, dtype: torch.dtype) -> list[Segment] | None:
        src13, src2 = self.stacks[layer]
        return row_segments(([src13[local]], [src2[local]]), dtype)
