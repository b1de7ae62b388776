"""Zero-copy tensor views of a safetensors file, mapped once.

`safe_open(...).get_tensor` allocates a new tensor and copies the bytes into it on every call.
Expert offloading reads single experts from the checkpoint while serving (FineMoE's disk tier),
on the forward thread and on the prefetch thread: there that allocation (fresh pages, faulted
in, then unmapped) and the second copy cost more than the read itself. A view of the mapped
file copied into its destination with `Tensor.copy_` is one copy, made outside the GIL.

The format (https://github.com/huggingface/safetensors): 8 bytes little-endian header size N,
N bytes of JSON `{name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": ...}`,
then the data; offsets count from the first data byte.
"""

from __future__ import annotations

import json
import mmap
import struct
from pathlib import Path

import torch

_DTYPES = {
    "BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32, "F64": torch.float64,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool,
}


class MappedSafetensors:
    """One safetensors file, mapped copy-on-write (nothing writes it): `view(name)` is a tensor
    over the mapped bytes, valid while this object or the view lives."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        with open(self.path, "rb") as f:
            (header_len,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(header_len))
            # ACCESS_COPY: a private mapping, so torch sees a writable buffer (no warning) while the
            # pages stay shared with the page cache until written, which nothing does.
            self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
        header.pop("__metadata__", None)
        self._entries: dict[str, tuple[str, list[int], int, int]] = {
            name: (e["dtype"], e["shape"], 8 + header_len + e["data_offsets"][0], 8 + header_len + e["data_offsets"][1])
            for name, e in header.items()}
        self._bytes = torch.frombuffer(self._map, dtype=torch.uint8) if len(self._map) else torch.empty(0, dtype=torch.uint8)

    def names(self) -> list[str]:
        return list(self._entries)

    def dtype(self, name: str) -> str:
        """The stored dtype ("BF16", "F32", ...)."""
        return self._entries[name][0]

    def extent(self, name: str) -> tuple[torch.dtype, list[int], int] | None:
        """Tensor `name`'s dtype, shape and byte offset in the file (for a reader that does not go
        through the mapping), or None for a dtype without a torch equivalent here."""
        dtype_name, shape, begin, _ = self._entries[name]
        dtype = _DTYPES.get(dtype_name)
        return None if dtype is None else (dtype, list(shape), begin)

    def view(self, name: str) -> torch.Tensor | None:
        """Tensor `name` over the mapped bytes (no copy), or None for a dtype without a torch
        equivalent here (the caller then reads it through safetensors)."""
        dtype_name, shape, begin, end = self._entries[name]
        dtype = _DTYPES.get(dtype_name)
        if dtype is None:
            return None
        if begin % dtype.itemsize:  # an unaligned tensor cannot be viewed in its dtype
            return None
        return self._bytes[begin:end].view(dtype).view(shape)
