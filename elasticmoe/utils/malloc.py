"""Keep freed activation buffers in the process heap instead of returning them to the OS.

glibc serves large allocations with fresh `mmap`s and unmaps them on free, so
every temporary tensor of a step page-faults its memory in again (measured
here: a bf16 RMSNorm over [2048, 512] took 3.1 ms instead of 0.47 ms). Raising
the mmap and trim thresholds makes the heap reuse those pages, which is what
a caching allocator does on GPUs.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

logger = logging.getLogger(__name__)

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_done = False


def tune_malloc(threshold_bytes: int = 1 << 30) -> bool:
    """Raise glibc's mmap/trim thresholds once per process; False where glibc is not in use."""
    global _done
    if _done:
        return True
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name or "libc.so.6")
        ok = libc.mallopt(_M_MMAP_THRESHOLD, threshold_bytes) == 1
        ok = libc.mallopt(_M_TRIM_THRESHOLD, 2 * threshold_bytes) == 1 and ok
    except (OSError, AttributeError):
        ok = False
    _done = ok
    if not ok:
        logger.info("mallopt unavailable: large temporaries will be mmap'd per allocation")
    return ok
