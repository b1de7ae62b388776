"""Device-memory files in /dev/shm by name: create, unlink, list, and find the ones a process maps.

The tensors on them are `shm`'s; this module has no PyTorch, so what only names or counts
segments (a config's default prefix, a leak check, a reaper) does not load it.
"""

from __future__ import annotations

import os
import re
import secrets

from hmm.memory import lease
from hmm.memory.lease import SHM_DIR
from hmm.memory.libc import PAGE_SIZE

DEFAULT_PREFIX = "emoe"


def round_up(num_bytes: int, align: int = PAGE_SIZE) -> int:
    return -(-num_bytes // align) * align


def list_segments(prefix: str) -> list[str]:
    """Names of files in /dev/shm that start with `prefix-`, leases included (leak checks)."""
    return sorted(n for n in os.listdir(SHM_DIR) if n.startswith(f"{prefix}-"))


# A segment's path (`create_segment`) in /proc/<pid>/maps, " (deleted)" once freed.
_SEGMENT_MAP = re.compile(r"(/dev/shm/[^/\s]+-d[A-Za-z0-9_.]+-[a-z]+-[^-\s]+-[0-9a-f]{12})(?: \(deleted\))?$")


def mapped_segments(pid: int | str = "self") -> list[str]:
    """Device-memory segments a process still maps (freed ones included): a process that
    dropped every tensor of a device maps none."""
    with open(f"/proc/{pid}/maps") as maps:
        found = {m.group(1) for line in maps if (m := _SEGMENT_MAP.search(line.rstrip("\n")))}
    return sorted(found)


def create_segment(prefix: str, device_id: str, num_bytes: int, kind: str = "t") -> tuple[int, str, str]:
    """Create a new file `<prefix>-d<device>-<kind>-<owner>-<random>` in /dev/shm with `num_bytes`
    allocated; return (open fd, path, name). The name carries this process's lease (`lease.py`),
    so the file is reaped if the process dies holding it. Created with O_EXCL, so a clash fails
    loudly instead of sharing memory.

    The memory is allocated up front (`posix_fallocate`), like a device
    allocation: a full /dev/shm fails here with ENOSPC instead of SIGBUS later.
    On any failure nothing is left behind.
    """
    dev = re.sub(r"[^A-Za-z0-9_.]", "_", device_id)
    owner = lease.acquire(prefix)
    name = f"{prefix}-d{dev}-{kind}-{owner}-{secrets.token_hex(6)}"
    path = os.path.join(SHM_DIR, name)
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    except BaseException:
        lease.release(prefix)
        raise
    try:
        os.ftruncate(fd, num_bytes)
        if num_bytes:
            os.posix_fallocate(fd, 0, num_bytes)
    except BaseException:
        os.close(fd)
        unlink_segment(path)
        raise
    return fd, path, name


def unlink_segment(path: str) -> None:
    """Remove a file made by `create_segment` (mappings stay valid until dropped) and end its
    share of the lease. A file already gone (reaped) is fine."""
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    match = lease.segment_prefix(os.path.basename(path))
    if match is not None:
        lease.release(match)
