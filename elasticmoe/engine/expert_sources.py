"""Where an offloaded expert's weights are read from when the expert cache loads it.

Two tiers below the cache (DESIGN.md "Memory tiers"):
- `DiskExperts`: the checkpoint's safetensors, read with `pread` from files opened once (the OS
  page cache keeps recently read experts in host memory for free). The engine's own process holds
  nothing else of the routed experts: this is the tier that lets a model larger than the budget
  run. Not through a mapping: a checkpoint file truncated or rewritten in place while the server
  runs (`cp` over it) would fault the process at the next copy from a page past its new end
  (SIGBUS, in any copy, native or PyTorch), while a read returns an error or a short count, which
  fails the load and only the requests that needed it. With `drop_pages` each read drops the
  pages it read from the page cache (and the files are read without readahead): the experts then
  take no host memory beyond the cache's rows, which is what a checkpoint larger than the host's
  memory gets, and every miss is a real disk read (`--expert-page-cache drop`).
- `HostExperts`: full expert stacks some other owner already keeps in host memory (the HMM's
  shared memory, one copy per node, handed to the engine through a `WeightProvider`); a load
  is one memory copy.

Both copy one expert into one row of the cache's pool tensors and report the bytes copied, and
both describe that copy as raw segments (`segments`) for the native copy thread that runs the
prefetches (`elasticmoe.engine.expert_copier`). The forward thread and the copy thread may read one
source at once; neither writes it, so it holds no lock.
"""

from __future__ import annotations

import contextlib
import errno
import math
import os
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch

from elasticmoe.kernels.copy_engine import BF16_TO_F32, MEMCPY, READ_FILE, READ_FILE_BF16_TO_F32
from elasticmoe.models.weights import ParamSpec, SafetensorsWeightProvider

# (source address or file descriptor, pool: 0 = w13 / 1 = w2, byte offset in the pool row, count,
# kind, file offset): one piece of an expert's copy in the native copy engine's terms
# (`elasticmoe.kernels.copy_engine`)
Segment = tuple[int, int, int, int, int, int]
_PAGE = os.sysconf("SC_PAGESIZE")


class ExpertSource(Protocol):
    tier: str  # "disk" or "host": the label of the bytes it loads in the metrics
    drops_pages: bool  # a file read drops the pages it read from the OS page cache

    def copy_into(self, layer: int, local: int, w13: torch.Tensor, w2: torch.Tensor) -> int:
        """Write MoE layer `layer`'s expert of local index `local` into the rows `w13` [2I, H] and
        `w2` [H, I]; returns the bytes written."""
        ...

    def segments(self, layer: int, local: int, dtype: torch.dtype) -> list[Segment] | None:
        """The same copy into pool rows of `dtype` as raw segments, or None where the native engine
        cannot make it (a conversion it does not have): the expert is then copied by `copy_into`."""
        ...


@dataclass(frozen=True, slots=True)
class FilePart:
    """A checkpoint tensor's bytes in a file opened for reading (`fd`, from byte `offset`)."""

    path: Path
    fd: int
    offset: int
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    def segment(self, pool: int, offset: int, dtype: torch.dtype) -> Segment | None:
        """This part read into byte `offset` of a pool row of `dtype`; None: no native kind."""
        kind = _native_kind(self.dtype, self.numel, dtype, from_file=True)
        return None if kind is None else (self.fd, pool, offset, kind[1], kind[0], self.offset)

    def read_into(self, dst: torch.Tensor, drop_pages: bool = False) -> None:
        """Read this part into `dst` (contiguous, its shape), converting the dtype; `OSError` when
        the read fails or the file ends first (truncated under the server). `drop_pages`: then drop
        the pages read from the page cache."""
        if not dst.is_contiguous() or tuple(dst.shape) != self.shape:
            raise ValueError(f"{self.path}: a part of shape {self.shape} reads into a contiguous tensor of its "
                             f"shape, got {tuple(dst.shape)}")
        target = dst if dst.dtype == self.dtype else torch.empty(self.shape, dtype=self.dtype)
        buffer = target.reshape(-1).view(torch.uint8).numpy().data
        done = 0
        while done < len(buffer):  # `preadv` releases the GIL; a short count is not yet the end
            n = os.preadv(self.fd, [buffer[done:]], self.offset + done)
            if n == 0:
                raise OSError(errno.EIO, f"{self.path} ends {len(buffer) - done} bytes before this expert does "
                                         "(was the checkpoint replaced in place while serving?)")
            done += n
        if drop_pages:
            drop_cached(self.fd, self.offset, len(buffer))
        if target is not dst:
            dst.copy_(target)


def drop_cached(fd: int, offset: int, length: int) -> None:
    """Drop from the page cache every page of file `fd` that bytes [offset, offset + length) touch,
    the partly read ones at both ends too (the kernel keeps a page the range covers only in part):
    csrc/copy_engine.cpp's rule. Advice: a failure leaves them cached."""
    first = offset // _PAGE * _PAGE
    with contextlib.suppress(OSError):  # the read has succeeded: a page left cached costs memory, not the copy
        os.posix_fadvise(fd, first, -(-(offset + length) // _PAGE) * _PAGE - first, os.POSIX_FADV_DONTNEED)


def _native_kind(src_dtype: torch.dtype, numel: int, dtype: torch.dtype, from_file: bool) -> tuple[int, int] | None:
    """(kind, count) of the native copy of `numel` values of `src_dtype` into a pool row of `dtype`:
    as is (count in bytes) or widened from bf16 to fp32 (count in values); None: no native kind."""
    if src_dtype == dtype:
        return (READ_FILE if from_file else MEMCPY, numel * dtype.itemsize)
    if src_dtype == torch.bfloat16 and dtype == torch.float32:
        return (READ_FILE_BF16_TO_F32 if from_file else BF16_TO_F32, numel)
    return None


def tensor_segment(src: torch.Tensor, pool: int, offset: int, dtype: torch.dtype) -> Segment | None:
    """`src` (contiguous) written at byte `offset` of a pool row of `dtype`; None: no native kind."""
    kind = _native_kind(src.dtype, src.numel(), dtype, from_file=False) if src.is_contiguous() else None
    return None if kind is None else (src.data_ptr(), pool, offset, kind[1], kind[0], 0)


def row_segments(parts_per_pool: Sequence[Sequence[FilePart | torch.Tensor]], dtype: torch.dtype
                 ) -> list[Segment] | None:
    """Segments of one expert whose pool row `pool` is the concatenation (dim 0) of `parts_per_pool[pool]`
    (tensors in memory, or parts of files)."""
    out: list[Segment] = []
    for pool, parts in enumerate(parts_per_pool):
        offset = 0
        for part in parts:
            segment = (part.segment(pool, offset, dtype) if isinstance(part, FilePart)
                       else tensor_segment(part, pool, offset, dtype))
            if segment is None:
                return None
            out.append(segment)
            offset += math.prod(part.shape) * dtype.itemsize
    return out


@dataclass(frozen=True, slots=True)
class LayerExpertSpecs:
    """One MoE layer's two expert stacks: row i of each is built from `sources[i]`."""

    w13: ParamSpec
    w2: ParamSpec


class DiskExperts:
    """Experts read from the checkpoint on demand, one row at a time, with `pread` (see the module
    docstring): on the forward thread by `copy_into`, on the copy thread from `segments`. Each file
    is opened once, here, and closed when this source is collected: the native copier keeps its
    source alive until its thread has stopped. `drop_pages`: every read drops the pages it read
    from the page cache, and the files are read without readahead (which would cache neighbours);
    what earlier reads left cached (the dense weights' load at start reads around them) is dropped
    here, but for pages mapped in some process."""

    tier = "disk"

    def __init__(self, model_dir: str, layers: Sequence[LayerExpertSpecs], drop_pages: bool = False) -> None:
        self.layers = list(layers)
        self.drops_pages = drop_pages
        self.reader = SafetensorsWeightProvider(model_dir)
        self._fds: dict[Path, int] = {}
        weakref.finalize(self, _close_files, self._fds)
        self._parts = [(self._sources(spec.w13), self._sources(spec.w2)) for spec in self.layers]
        if drop_pages:  # what reads before this one left cached (the start's, and their readahead)
            for fd in self._fds.values():
                drop_cached(fd, 0, os.fstat(fd).st_size)  # the pages something maps stay: the kernel keeps them

    def _sources(self, spec: ParamSpec) -> list[list[FilePart | torch.Tensor]]:
        """Per local expert, the checkpoint tensors its row is concatenated from (dim 0): their
        places in the files, or (a dtype torch cannot name) the tensors read now."""
        experts: list[list[FilePart | torch.Tensor]] = []
        for group in spec.sources:
            parts = [self._part(name) for name in group]
            if sum(p.shape[0] for p in parts) != spec.shape[1] or any(p.shape[1:] != spec.shape[2:] for p in parts):
                raise ValueError(f"checkpoint tensors {group} do not make a {list(spec.shape[1:])} expert row")
            experts.append(parts)
        return experts

    def _part(self, name: str) -> FilePart | torch.Tensor:
        extent = self.reader.file_extent(name)
        if extent is None:
            return self.reader.mapped_view(name)
        path, dtype, shape, offset = extent
        if path not in self._fds:
            self._fds[path] = fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
            if self.drops_pages:
                with contextlib.suppress(OSError):  # advice, as the drops are
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
        return FilePart(path, self._fds[path], offset, dtype, tuple(shape))

    def copy_into(self, layer: int, local: int, w13: torch.Tensor, w2: torch.Tensor) -> int:
        for dst, parts in ((w13, self._parts[layer][0][local]), (w2, self._parts[layer][1][local])):
            pieces = [dst] if len(parts) == 1 else dst.split([p.shape[0] for p in parts])
            for piece, part in zip(pieces, parts, strict=True):
                if isinstance(part, FilePart):
                    part.read_into(piece, self.drops_pages)
                else:
                    piece.copy_(part)
        return w13.nbytes + w2.nbytes

    def segments(self, layer: int, local: int, dtype: torch.dtype) -> list[Segment] | None:
        return row_segments((self._parts[layer][0][local], self._parts[layer][1][local]), dtype)


def _close_files(fds: dict[Path, int]) -> None:
    for fd in fds.values():
        os.close(fd)
    fds.clear()


class HostExperts:
    """Experts copied from full stacks kept in host memory by their owner."""

    tier = "host"
    drops_pages = False

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
