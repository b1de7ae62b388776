"""`PagePool`: the physical pages of one device, as fixed-size slices of one
shared file in /dev/shm.

A page is "physical memory" that can be mapped into many places: any number of
virtual tensors, in this process or another (by file name + page offset), which
is what makes expert remapping and zero-copy attach O(pages). The file is sparse;
a page's memory exists from `allocate` (posix_fallocate, like `MallocPhysical`)
until its last reference is released (hole punched: memory back to the kernel,
the page reads as zeros when handed out again).
"""

from __future__ import annotations

import logging
import mmap
import os
import weakref
from collections.abc import Sequence

import torch

from hmm.memory.accounting import MemoryAccount
from hmm.memory.libc import PAGE_SIZE, punch_hole
from hmm.memory.page_table import PageAllocator
from hmm.memory.segments import DEFAULT_PREFIX, create_segment, unlink_segment

logger = logging.getLogger(__name__)

DEFAULT_PAGE_SIZE = 2 * 1024 * 1024


def _close_pool(fd: int, path: str) -> None:
    unlink_segment(path)
    os.close(fd)


class PagePool(PageAllocator):
    """Pages of `page_size` bytes (a multiple of the OS page) of one device.

    Invariants: page `p` is bytes `[p * page_size, (p + 1) * page_size)` of file
    `name`; live pages are charged to `account` (see `PageAllocator`). A page is
    released to the pool only when no virtual tensor of this process maps it.
    # NOTE: other processes that opened a handle are not counted: the HMM must not
    # unmap a page in the owner while an older instance still reads it (`commit`).
    """

    def __init__(
        self,
        account: MemoryAccount,
        page_size: int = DEFAULT_PAGE_SIZE,
        num_pages: int | None = None,
        prefix: str = DEFAULT_PREFIX,
    ) -> None:
        if page_size <= 0 or page_size % PAGE_SIZE:
            raise ValueError(
                f"page_size {page_size} must be a positive multiple of the OS page ({PAGE_SIZE})"
            )
        num_pages = account.budget // page_size if num_pages is None else num_pages
        super().__init__(num_pages, page_size, account)
        self.device_id = account.device_id
        self.fd, self.path, self.name = create_segment(prefix, account.device_id, 0, kind="pool")
        os.ftruncate(self.fd, max(num_pages * page_size, 1))  # sparse: no memory until allocate
        self._mm: mmap.mmap | None = None
        self._finalizer = weakref.finalize(self, _close_pool, self.fd, self.path)

    @property
    def file_bytes(self) -> int:
        return self.num_pages * self.page_size

    def allocate(self, num_pages: int) -> list[int]:
        page_ids = super().allocate(num_pages)
        try:
            for start, length in self._runs(page_ids):
                os.posix_fallocate(self.fd, start, length)
        except OSError:
            self.release(page_ids)
            raise
        return page_ids

    def _on_free(self, page_ids: list[int]) -> None:
        for start, length in self._runs(page_ids):
            punch_hole(self.fd, start, length)

    def page_view(self, page_id: int) -> torch.Tensor:
        """The bytes of one page as a `uint8[page_size]` tensor (the pool's own mapping).

        Debugging and tests: writes here are visible in every virtual tensor that
        maps the page, and vice versa.
        """
        if not 0 <= page_id < self.num_pages:
            raise IndexError(f"page {page_id} out of range [0, {self.num_pages})")
        if self._mm is None:
            self._mm = mmap.mmap(self.fd, self.file_bytes, flags=mmap.MAP_SHARED)
        return torch.frombuffer(
            self._mm, dtype=torch.uint8, count=self.page_size, offset=page_id * self.page_size
        )

    def close(self) -> None:
        """Unlink the pool file. Mappings still open (here or elsewhere) stay valid
        until dropped; live pages stay charged until released."""
        if self.num_used:
            logger.warning("device %s: closing page pool with %d live pages", self.device_id, self.num_used)
        self._mm = None
        self._finalizer()

    def _runs(self, page_ids: Sequence[int]) -> list[tuple[int, int]]:
        """Byte ranges of `page_ids`, merging consecutive pages (fewer syscalls)."""
        runs: list[tuple[int, int]] = []
        for p in sorted(page_ids):
            start = p * self.page_size
            if runs and runs[-1][0] + runs[-1][1] == start:
                runs[-1] = (runs[-1][0], runs[-1][1] + self.page_size)
            else:
                runs.append((start, self.page_size))
        return runs
