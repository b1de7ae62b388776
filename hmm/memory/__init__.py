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

# name -> the submodule that defines it; `__all__` is these names
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
__all__ = sorted(_WHERE)

if TYPE_CHECKING:  # what a type checker sees (the same names)
    from hmm.memory.accounting import MemoryAccount as MemoryAccount
    from hmm.memory.accounting import MemoryUsage as MemoryUsage
    from hmm.memory.accounting import OutOfDeviceMemory as OutOfDeviceMemory
    from hmm.memory.handle import TensorHandle as TensorHandle
    from hmm.memory.page_pool import DEFAULT_PAGE_SIZE as DEFAULT_PAGE_SIZE
    from hmm.memory.page_pool import PagePool as PagePool
    from hmm.memory.page_table import PageAllocator as PageAllocator
    from hmm.memory.page_table import PageTable as PageTable
    from hmm.memory.page_table import SlotLayout as SlotLayout
    from hmm.memory.page_table import SlotPages as SlotPages
    from hmm.memory.page_table import pages_needed as pages_needed
    from hmm.memory.segments import list_segments as list_segments
    from hmm.memory.shm import ShmBackend as ShmBackend
    from hmm.memory.shm import open_tensor as open_tensor
    from hmm.memory.vpage import VirtualTensor as VirtualTensor
    from hmm.memory.vpage import VirtualTensorHandle as VirtualTensorHandle
    from hmm.memory.vpage import map_slot_pages as map_slot_pages
    from hmm.memory.vpage import open_virtual_tensor as open_virtual_tensor
    from hmm.memory.vpage import unmap_slot_pages as unmap_slot_pages


def __getattr__(name: str) -> Any:
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{module}"), name)
