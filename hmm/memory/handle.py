"""`TensorHandle`: a picklable reference to a tensor living in device memory.

A handle names the pages, not a copy: opening it in any process on the node
(`hmm.memory.shm.open_tensor`) gives a tensor over the same physical memory. It is
valid until the owning device frees the allocation; mappings opened before the
free stay valid until they are dropped (POSIX unlink semantics).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

_DTYPES: dict[str, torch.dtype] = {
    name: dt
    for name in (
        "float32",
        "float16",
        "bfloat16",
        "float64",
        "int8",
        "uint8",
        "int16",
        "int32",
        "int64",
        "bool",
    )
    if isinstance(dt := getattr(torch, name), torch.dtype)
}


def dtype_to_str(dtype: torch.dtype) -> str:
    """`torch.bfloat16` -> `"bfloat16"` (the form stored in handles)."""
    name = str(dtype).removeprefix("torch.")
    if name not in _DTYPES:
        raise ValueError(f"unsupported dtype for device memory: {dtype}")
    return name


def dtype_from_str(name: str) -> torch.dtype:
    """`"bfloat16"` -> `torch.bfloat16`."""
    try:
        return _DTYPES[name]
    except KeyError:
        raise ValueError(f"unknown dtype name {name!r}; expected one of {sorted(_DTYPES)}") from None


def contiguous_stride(shape: tuple[int, ...]) -> tuple[int, ...]:
    """Row-major strides (in elements) of a contiguous tensor of `shape`."""
    stride: list[int] = []
    acc = 1
    for size in reversed(shape):
        stride.append(acc)
        acc *= max(size, 1)
    return tuple(reversed(stride))


@dataclass(frozen=True, slots=True)
class TensorHandle:
    """Where a tensor's bytes live and how to view them.

    Invariants: `offset` is in bytes from the start of segment `name`; `stride`
    is in elements; the viewed extent `offset + nbytes` lies inside the segment.
    """

    backend: str  # "shm": `name` is a file under /dev/shm
    name: str
    offset: int
    shape: tuple[int, ...]
    dtype: str
    stride: tuple[int, ...]
    device_id: str = ""

    def __post_init__(self) -> None:
        if self.backend != "shm":
            raise ValueError(f"unknown backend {self.backend!r}")
        if len(self.shape) != len(self.stride):
            raise ValueError(f"shape {self.shape} and stride {self.stride} differ in rank")
        if self.offset < 0 or any(s < 0 for s in self.shape) or any(s < 0 for s in self.stride):
            raise ValueError(f"negative offset/shape/stride in {self}")
        dtype_from_str(self.dtype)

    @property
    def itemsize(self) -> int:
        return dtype_from_str(self.dtype).itemsize

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        """Bytes spanned by the view (from its first to one past its last element)."""
        if self.numel == 0:
            return 0
        last = sum((size - 1) * st for size, st in zip(self.shape, self.stride, strict=True))
        return (last + 1) * self.itemsize

    def select(self, index: int) -> TensorHandle:
        """Handle of `tensor[index]` (dim 0), e.g. one expert of a stacked `[E, ...]` tensor."""
        if not self.shape or not 0 <= index < self.shape[0]:
            raise IndexError(f"index {index} out of range for shape {self.shape}")
        return TensorHandle(
            backend=self.backend,
            name=self.name,
            offset=self.offset + index * self.stride[0] * self.itemsize,
            shape=self.shape[1:],
            dtype=self.dtype,
            stride=self.stride[1:],
            device_id=self.device_id,
        )
