"""Where model weights come from.

A model declares the tensors it needs as `ParamSpec`s (engine names, shapes,
and the checkpoint tensors each is made of). A `WeightProvider` returns one
tensor per spec. The engine uses what the provider returns *in place*: an HMM
provider hands out tensors that live in shared device memory, and the engine
must not copy them (tests check `data_ptr` identity).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Protocol

import torch
from safetensors import safe_open

from elasticmoe.models.safetensors_mmap import MappedSafetensors

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class ParamSpec:
    """One engine tensor and how it is assembled from checkpoint tensors.

    `sources[i]` lists checkpoint tensors concatenated along dim 0. When
    `expert_ids` is set the tensor is a stack of experts: row `i` of the stack
    is built from `sources[i]` and holds global expert `expert_ids[i]`; rows
    past `len(expert_ids)` (`shape[0]` may be larger: ESFT adapter slots, see
    `with_adapter_slots`) are left unfilled. Otherwise there is exactly one
    entry in `sources`.
    """

    name: str
    shape: tuple[int, ...]
    sources: tuple[tuple[str, ...], ...]
    expert_ids: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        if self.expert_ids is None and len(self.sources) != 1:
            raise ValueError(f"{self.name}: a non-stacked param has exactly one source group")
        if self.expert_ids is not None and len(self.expert_ids) != len(self.sources):
            raise ValueError(f"{self.name}: one source group per stacked expert")
        if self.expert_ids is not None and self.shape[0] < len(self.expert_ids):
            raise ValueError(f"{self.name}: {self.shape[0]} rows cannot stack {len(self.expert_ids)} experts")

    @property
    def is_stacked(self) -> bool:
        return self.expert_ids is not None


class WeightProvider(Protocol):
    def get(self, spec: ParamSpec, dtype: torch.dtype) -> torch.Tensor:
        """Return a tensor of `spec.shape` and `dtype`, owned by the provider."""
        ...


class SafetensorsWeightProvider:
    """Default provider: reads the checkpoint's safetensors into private memory.

    Each checkpoint tensor is read once (mmap'd by safetensors) and copied
    straight into the engine tensor, converting dtype on the way.
    """

    def __init__(self, model_dir: str | Path) -> None:
        self.model_dir = Path(model_dir)
        self._file_of: dict[str, Path] = {}
        index = self.model_dir / "model.safetensors.index.json"
        if index.is_file():
            for name, fname in json.loads(index.read_text())["weight_map"].items():
                self._file_of[name] = self.model_dir / fname
        else:
            for path in sorted(self.model_dir.glob("*.safetensors")):
                with safe_open(str(path), framework="pt") as f:
                    for name in f.keys():
                        self._file_of[name] = path
        if not self._file_of:
            raise FileNotFoundError(f"model: no safetensors weights in {self.model_dir}")
        self._handles: dict[Path, object] = {}
        self._mapped: dict[Path, MappedSafetensors] = {}  # read_into's zero-copy views
        self.bytes_read = 0

    @property
    def files(self) -> list[Path]:
        """The checkpoint's safetensors files."""
        return sorted(set(self._file_of.values()))

    def has(self, name: str) -> bool:
        return name in self._file_of

    def file_extent(self, name: str) -> tuple[Path, torch.dtype, list[int], int] | None:
        """Where checkpoint tensor `name` lies: (file, dtype, shape, byte offset), or None for a dtype
        torch has no equivalent of (read it with `mapped_view`)."""
        extent = self._mapping(name).extent(name)
        return None if extent is None else (self._path(name), *extent)

    def stored_dtype(self, name: str) -> str:
        """The safetensors dtype a checkpoint tensor is stored in ("BF16", "F32", ...), header only."""
        return self._mapping(name).dtype(name)

    def read(self, name: str) -> torch.Tensor:
        t = self._handle(name).get_tensor(name)  # type: ignore[attr-defined]
        self.bytes_read += t.numel() * t.element_size()
        return t

    def _path(self, name: str) -> Path:
        path = self._file_of.get(name)
        if path is None:
            raise KeyError(f"checkpoint tensor {name!r} not found in {self.model_dir}")
        return path

    def _mapping(self, name: str) -> MappedSafetensors:
        """The mapped file holding `name` (mapped once, header parsed once)."""
        path = self._path(name)
        mapped = self._mapped.get(path)
        if mapped is None:
            mapped = self._mapped[path] = MappedSafetensors(path)
        return mapped

    def _handle(self, name: str) -> object:
        path = self._path(name)
        handle = self._handles.get(path)
        if handle is None:
            handle = self._handles[path] = safe_open(str(path), framework="pt")
        return handle

    def read_into(self, dst: torch.Tensor, names: tuple[str, ...]) -> None:
        """Copy checkpoint tensors `names`, concatenated along dim 0, into `dst` (converting dtype):
        one copy from the mapped file per tensor (see `safetensors_mmap`)."""
        offset = 0
        for name in names:
            src = self.mapped_view(name)
            dst[offset : offset + src.shape[0]].copy_(src)
            offset += src.shape[0]
            self.bytes_read += src.numel() * src.element_size()
        if offset != dst.shape[0]:
            raise ValueError(f"checkpoint tensors {names} give {offset} rows, expected {dst.shape[0]}")

    def mapped_view(self, name: str) -> torch.Tensor:
        """Checkpoint tensor `name` as a read-only view of the mapped file (no copy; do not write
        it), or, for a dtype torch cannot view in place, as safetensors reads it."""
        view = self._mapping(name).view(name)
        return view if view is not None else self._handle(name).get_tensor(name)  # type: ignore[attr-defined]

    def get(self, spec: ParamSpec, dtype: torch.dtype) -> torch.Tensor:
        out = torch.empty(spec.shape, dtype=dtype)
        rows: Iterable[tuple[torch.Tensor, tuple[str, ...]]]
        if spec.is_stacked:  # rows past the experts (adapter slots) stay unwritten: no page is touched
            rows = zip(out[: len(spec.sources)], spec.sources, strict=True)
        else:
            rows = [(out, spec.sources[0])]
        for dst, names in rows:
            self.read_into(dst, names)
        return out

    def close(self) -> None:
        self._handles.clear()
        self._mapped.clear()  # each mapping closes once its last view is gone


def stores_as_bf16(specs: list[ParamSpec], provider: SafetensorsWeightProvider) -> bool:
    """Whether every checkpoint tensor of `specs` is stored in bf16 (then a bf16 copy of them is
    exact, whatever dtype the model computes in)."""
    names = [name for spec in specs for group in spec.sources for name in group]
    return bool(names) and all(provider.stored_dtype(name) == "BF16" for name in names)


def with_adapter_slots(specs: list[ParamSpec], extra_rows: int) -> list[ParamSpec]:
    """The specs with every expert stack grown by `extra_rows` unfilled rows (ESFT adapter slots:
    `[E_local + N*E_max, ...]`, ExpertWeave's virtual weight tensor)."""
    if extra_rows < 0:
        raise ValueError(f"extra_rows: must be >= 0, got {extra_rows}")
    return [
        replace(s, shape=(s.shape[0] + extra_rows, *s.shape[1:])) if s.is_stacked and extra_rows else s
        for s in specs
    ]


def load_weights(specs: list[ParamSpec], provider: WeightProvider, dtype: torch.dtype,
                 stacked_dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """Fetch every spec from the provider, checking shapes and dtypes. `stacked_dtype`: the dtype of
    expert stacks when it differs (bf16 storage of bf16 checkpoint experts computed in fp32)."""
    weights = {}
    for spec in specs:
        want = stacked_dtype if stacked_dtype is not None and spec.is_stacked else dtype
        t = provider.get(spec, want)
        if tuple(t.shape) != spec.shape or t.dtype != want:
            raise ValueError(f"{spec.name}: provider gave {tuple(t.shape)}/{t.dtype}, expected {spec.shape}/{want}")
        weights[spec.name] = t
    return weights
