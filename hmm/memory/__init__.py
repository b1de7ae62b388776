"""Device memory primitives of the HMM (CPU backend; see DESIGN.md "What a device is here").

- `shm`: tensors in /dev/shm files, `TensorHandle` export/open (zero-copy), free.
- `accounting`: per-device current/peak bytes against a budget.
- `page_pool` / `vpage`: physical page pool and virtual tensors (vpage-remap,
  ExpertWeave's virtual weight tensor with sub-page sharing).
- `fragmentation`: ESFT memory fragmentation factor F_mem.
"""

from hmm.memory.accounting import MemoryAccount, MemoryUsage, OutOfDeviceMemory
from hmm.memory.handle import TensorHandle
from hmm.memory.page_pool import DEFAULT_PAGE_SIZE, PagePool
from hmm.memory.page_table import PageAllocator, PageTable, SlotLayout, SlotPages, pages_needed
from hmm.memory.shm import ShmBackend, list_segments, open_tensor
from hmm.memory.vpage import (
    VirtualTensor,
    VirtualTensorHandle,
    map_slot_pages,
    open_virtual_tensor,
    unmap_slot_pages,
)

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
    "open_tensor",
    "open_virtual_tensor",
    "map_slot_pages",
    "unmap_slot_pages",
    "pages_needed",
]
