"""Engine providers over HMM handles: how an `LLMEngine` is built on HMM memory.

`HandleWeightProvider.get` opens the handle of each param in this process and
returns the mapped tensor itself; the engine uses it in place (zero-copy: the
weights' `data_ptr`s are addresses of the mapping, recorded in `opened`).
`HandleKVProvider.allocate` views the device's `uint8` KV pool with the engine's
KV shape and faults its pages in ahead of the engine's first writes (`shm.prefault`).
Mappings stay valid as long as the engine holds the tensors, even after the HMM
commits a new layout (freed shm files stay mapped until dropped; freed expert pages
read as zeros, so an instance must be retired before `commit`).
"""

from __future__ import annotations

import math
import threading
from collections.abc import Mapping

import torch

from elasticmoe.engine.kv_cache import KVCacheSpec
from elasticmoe.models.weights import ParamSpec
from hmm.layout import KV_POOL
from hmm.memory import TensorHandle, VirtualTensorHandle, open_tensor, open_virtual_tensor
from hmm.memory.handle import dtype_from_str
from hmm.memory.shm import prefault

Handle = TensorHandle | VirtualTensorHandle


def open_handle(handle: Handle) -> torch.Tensor:
    """The tensor of a shm or virtual-tensor handle, mapped in this process."""
    if isinstance(handle, VirtualTensorHandle):
        return open_virtual_tensor(handle)
    return open_tensor(handle)


class HandleWeightProvider:
    """`WeightProvider` over a handle set `{engine param name: handle}` (extra keys ignored)."""

    def __init__(self, handles: Mapping[str, Handle]) -> None:
        self.handles = dict(handles)
        self.opened: dict[str, torch.Tensor] = {}

    def get(self, spec: ParamSpec, dtype: torch.dtype) -> torch.Tensor:
        handle = self.handles.get(spec.name)
        if handle is None:
            raise KeyError(f"{spec.name}: not in the handle set")
        t = open_handle(handle)
        if tuple(t.shape) != spec.shape or t.dtype != dtype:
            raise ValueError(
                f"{spec.name}: handle is {tuple(t.shape)}/{t.dtype}, engine wants {spec.shape}/{dtype}"
            )
        self.opened[spec.name] = t
        return t


class HandleKVProvider:
    """`KVProvider` over a device's KV pool handle (a flat `uint8` shm tensor)."""

    def __init__(self, handle: TensorHandle) -> None:
        if dtype_from_str(handle.dtype) != torch.uint8 or len(handle.shape) != 1:
            raise ValueError(f"kv pool handle must be a flat uint8 tensor, got {handle.shape}/{handle.dtype}")
        self.handle = handle
        self.pool: torch.Tensor | None = None
        self.prefaulting: threading.Thread | None = None  # faults the pool in (`shm.prefault`)

    @classmethod
    def from_handle_set(cls, handles: Mapping[str, Handle]) -> HandleKVProvider:
        h = handles[KV_POOL]
        assert isinstance(h, TensorHandle)
        return cls(h)

    def num_blocks(self, spec: KVCacheSpec) -> int:
        """How many blocks of `spec` the pool holds."""
        return self.handle.numel // spec.bytes_per_block

    def allocate(self, spec: KVCacheSpec, num_blocks: int) -> torch.Tensor:
        shape = spec.pool_shape(num_blocks)
        need = math.prod(shape) * spec.dtype.itemsize
        if need > self.handle.numel:
            raise ValueError(
                f"kv pool: {num_blocks} blocks need {need} B, the device pool has {self.handle.numel} B"
            )
        raw = open_tensor(self.handle)
        self.pool = raw[:need].view(spec.dtype).view(shape)
        self.prefaulting = prefault(raw[:need], f"kv pool {self.handle.name}")
        return self.pool
