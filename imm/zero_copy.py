"""`ZeroCopyLoader`: engine providers from an HMM handle set, and a check that nothing was copied.

The paper's ZeroCopyLoader (§4.5) replaces the disk loader: the engine opens the
HMM's device tensors by handle and uses them in place. `check_zero_copy` proves
it after the engine is built: every engine weight *is* the provider's mapped
tensor (same `data_ptr`), and every weight and the KV pool live in a shared
file mapping (`/dev/shm/...` or a memfd) of this process, i.e. HMM memory, not
private memory filled from disk. A weight whose first row is reserved address space
(a virtual tensor with nothing mapped there: the disk tier's expert stacks) holds no data
at all, copied or not; it is counted as such.
"""

from __future__ import annotations

import bisect
import dataclasses
from collections.abc import Mapping
from typing import Any

import torch

from hmm.layout import EXPERT_CACHE, KV_POOL
from hmm.memory import TensorHandle
from hmm.providers import Handle, HandleKVProvider, HandleWeightProvider, open_handle

_SHARED_PREFIXES = ("/dev/shm/", "/memfd:")


@dataclasses.dataclass(frozen=True, slots=True)
class AttachReport:
    num_weights: int
    num_zero_copy: int  # engine weight is the provider's mapped tensor (same data_ptr)
    num_shared_mapped: int  # weight lies in a /dev/shm or memfd mapping
    kv_shared_mapped: bool
    attach_s: float
    # What the engine detected on this CPU and chose (ISA, bf16 GEMM path, kernel build, dtypes:
    # `cpu_compute_info`); None where not reported.
    compute: dict[str, Any] | None = None
    num_reserved: int = 0  # zero-copy weights whose first row is reserved address space (no pages)

    @property
    def is_zero_copy(self) -> bool:
        n = self.num_weights
        return (n > 0 and self.num_zero_copy == n and self.num_shared_mapped + self.num_reserved == n
                and self.kv_shared_mapped)


class ZeroCopyLoader:
    """Providers over one DP rank's handle set `{param name: handle, "kv_pool": handle}` (+
    `"expert_cache"`: the device's expert cache buffer, when the experts are offloaded)."""

    def __init__(self, handle_set: Mapping[str, Handle], kv_handle: TensorHandle | None = None) -> None:
        self.weights = HandleWeightProvider({k: v for k, v in handle_set.items() if k not in (KV_POOL, EXPERT_CACHE)})
        self.kv = HandleKVProvider(kv_handle) if kv_handle is not None else HandleKVProvider.from_handle_set(handle_set)
        cache = handle_set.get(EXPERT_CACHE)
        self.expert_cache: torch.Tensor | None = open_handle(cache) if cache is not None else None

    @property
    def kv_pool_bytes(self) -> int:
        return self.kv.handle.numel


def _mapped_ranges() -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """Sorted (start, end) of this process's shared-file mappings, and of its reserved address
    space (read-only, private, anonymous: what `hmm.memory.libc.reserve` holds)."""
    shared: list[tuple[int, int]] = []
    reserved: list[tuple[int, int]] = []
    with open("/proc/self/maps") as f:
        for line in f:
            parts = line.split(maxsplit=5)
            path = parts[5].strip() if len(parts) == 6 else ""
            start, end = (int(x, 16) for x in parts[0].split("-"))
            if path.startswith(_SHARED_PREFIXES):
                shared.append((start, end))
            elif not path and parts[1] == "r--p" and parts[4] == "0":
                reserved.append((start, end))
    return sorted(shared), sorted(reserved)


def _in_ranges(t: torch.Tensor, ranges: list[tuple[int, int]], starts: list[int]) -> bool:
    ptr = t.data_ptr()
    i = bisect.bisect_right(starts, ptr) - 1
    return i >= 0 and ranges[i][0] <= ptr < ranges[i][1]


def check_zero_copy(
    weights: Mapping[str, torch.Tensor],
    opened: Mapping[str, torch.Tensor],
    kv_pool: torch.Tensor,
    attach_s: float,
) -> AttachReport:
    ranges, reserved = _mapped_ranges()
    starts, reserved_starts = [r[0] for r in ranges], [r[0] for r in reserved]
    live = {n: t for n, t in weights.items() if t.numel() > 0}
    provided = {n for n, t in live.items() if n in opened and opened[n].data_ptr() == t.data_ptr()}
    return AttachReport(
        num_weights=len(live),
        num_zero_copy=len(provided),
        num_shared_mapped=sum(_in_ranges(t, ranges, starts) for t in live.values()),
        kv_shared_mapped=_in_ranges(kv_pool, ranges, starts),
        attach_s=attach_s,
        num_reserved=sum(_in_ranges(live[n], reserved, reserved_starts) for n in provided),
    )
