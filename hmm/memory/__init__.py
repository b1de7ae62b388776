"""Device memory primitives of the HMM (CPU backend; see DESIGN.md "What a device is here").

- `segments`: device-memory files in /dev/shm by name (create, unlink, list); no PyTorch.
- `shm`: tensors in /dev/shm files, `TensorHandle` export/open (zero-copy), free.
- `accounting`: per-device current/peak bytes against a budget.
- `page_pool` / `vpage`: physical page pool and virtual tensors (vpage-remap,
  ExpertWeave's virtual weight tensor with sub-page sharing).
- `fragmentation`: ESFT memory fragmentation factor F_mem.

The names below are imported on first use (PEP 562), not with the package: importing
`hmm.memory.segments` (the elastic server's config and ingress do) must not load PyTorch
through `shm` and `vpage`.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from hmm.memory.accounting import MemoryAccount, MemoryUsage, OutOfDeviceMemory
    from hmm.memory.handle import TensorHandle
    from hmm.memory.page_pool import DEFAULT_PAGE_SIZE, PagePool
    from hmm.memory.page_table import PageAllocator, PageTable, SlotLayout, SlotPages, pages_needed
    from hmm.memory.segments import list_segments
    from hmm.memory.shm import ShmBackend, open_tensor
    from hmm.memory.vpage import (
        VirtualTensor,
        VirtualTensorHandle,
        map_slot_pages,
        open_virtual_tensor,
        unmap_slot_pages,
    )

_WHERE = {
    "MemoryAccount": "accounting", "MemoryUsage": "accounting", "OutOfDeviceMemory": "accounting",
    "TensorHandle": "handle",
    "DEFAULT_PAGE_SIZE": "page_pool", "PagePool": "page_pool",
    "PageAllocator": "page_table", "PageTable": "page_table", "SlotLayout": "page_table", "SlotPages": "page_table",
    "pages_needed": "page_table",
    "list_segments": "segments",
    "ShmBackend": "shm", "open_tensor": "shm",
    "VirtualTensor": "vpage", "VirtualTensorHandle": "vpage", "map_slot_pages": "vpage",
    "open_virtual_tensor": "vpage", "unmap_slot_pages": "vpage",
}

__all__ = [
    "DEFAULT_PAGE_SIZE",
    "MemoryAccount",
    "MemoryUsage",
    "OutOfDeviceMemory",
    "PageAllocator",
    "PagePool",
    "PageTable",
    "ShmBackend",
    "SlotLayout",
    "SlotPages",
    "TensorHandle",
    "VirtualTensor",
    "VirtualTensorHandle",
    "list_segments",
    "map_slot_pages",
    "open_tensor",
    "open_virtual_tensor",
    "pages_needed",
    "unmap_slot_pages",
]


def __getattr__(name: str) -> Any:
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{module}"), name)
