"""Who owns a shared-memory file: a lease that ends when its process ends, however it ends.

The HMM's memory is files in /dev/shm, which outlive a process that dies without freeing
them (SIGKILL, a crashed device worker, a Serve replica restarted, a process group
SIGTERMed at once). So ownership is recorded where it survives the owner and where its
end is visible to anyone:

- Every process that creates HMM files holds one *lease* per name prefix: the file
  `/dev/shm/<prefix>-lease-<owner>` with an exclusive `flock` held on it for as long as the
  process lives. The kernel drops the lock when the process ends, however it ends.
- Each file it creates carries the owner id in its name: `<prefix>-d<device>-<kind>-<owner>-<random>`.
- `reap(prefix)` frees what no live process owns: files whose lease lock can be taken
  (the owner is gone) or whose lease file is gone, and those leases. Device workers reap
  when they start (a restarted worker or coordinator frees its predecessor's copy of the
  model), the server reaps when it stops, and `elasticmoe reap-shm` reaps on demand (`--all`:
  every prefix, `reap_all`).

A lease is released (its file removed) when the last file of its prefix in this process is
freed, so an orderly shutdown leaves nothing behind, not even the lease.
"""

from __future__ import annotations

import fcntl
import logging
import os
import re
import secrets
import threading

logger = logging.getLogger(__name__)

SHM_DIR = "/dev/shm"
_LEASE = "lease"
# `<prefix>-d<device>-<kind>-<owner>-<random>`, owner = `<pid>o<token>`
_SEGMENT = re.compile(r"^(?P<prefix>.+)-d[^-]+-[a-z]+-(?P<owner>\d+o[0-9a-f]+)-[0-9a-f]+$")
_LEASE_NAME = re.compile(r"^(?P<prefix>.+)-lease-(?P<owner>\d+o[0-9a-f]+)$")


class Lease:
    """This process's ownership of files named with `prefix` (see the module docstring)."""

    def __init__(self, prefix: str) -> None:
        self.prefix = prefix
        self.owner = f"{os.getpid()}o{secrets.token_hex(4)}"
        self.path = lease_path(prefix, self.owner)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BaseException:
            os.close(fd)
            os.unlink(self.path)
            raise
        self._fd: int | None = fd
        self.num_files = 0

    def release(self) -> None:
        """Give the lease up (its file removed); only once this process holds no file under it."""
        if self._fd is None:
            return
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass
        os.close(self._fd)
        self._fd = None


_leases: dict[str, Lease] = {}
_lock = threading.Lock()


def lease_path(prefix: str, owner: str) -> str:
    return os.path.join(SHM_DIR, f"{prefix}-{_LEASE}-{owner}")


def acquire(prefix: str) -> str:
    """Count one more file of this process under `prefix`; returns the owner id for its name."""
    with _lock:
        lease = _leases.get(prefix)
        if lease is None or os.getpid() != int(lease.owner.split("o")[0]):  # NOTE: a forked child needs its own
            lease = _leases[prefix] = Lease(prefix)
        lease.num_files += 1
        return lease.owner


def release(prefix: str) -> None:
    """One file of this process under `prefix` is gone; the last one ends the lease."""
    with _lock:
        lease = _leases.get(prefix)
        if lease is None:
            return
        lease.num_files -= 1
        if lease.num_files <= 0:
            del _leases[prefix]
            lease.release()


def segment_prefix(name: str) -> str | None:
    """The prefix of a file named by `create_segment`, or None for any other name."""
    match = _SEGMENT.match(name)
    return match["prefix"] if match else None


def _owner_is_gone(path: str) -> bool:
    """True if nobody holds the lease at `path` (its process ended); False if someone does."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
    except FileNotFoundError:
        return True
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    finally:
        os.close(fd)  # NOTE: closing drops a lock taken just now: a dead lease stays free to take
    return True


def reap(prefix: str, dry_run: bool = False) -> list[str]:
    """Unlink every file of `prefix` whose owner is gone, and the dead leases; returns their names
    (`dry_run`: only name them).

    Files are listed before leases: a file created after its lease (always) whose lease is
    not found afterwards has lost its owner. Files of live owners are never touched."""
    names = sorted(n for n in os.listdir(SHM_DIR) if n.startswith(f"{prefix}-"))
    lease_mark = f"{prefix}-{_LEASE}-"
    segments = [n for n in names if not n.startswith(lease_mark)]
    leases = {n[len(lease_mark):]: n for n in os.listdir(SHM_DIR) if n.startswith(lease_mark)}
    gone = {owner for owner, name in leases.items() if _owner_is_gone(os.path.join(SHM_DIR, name))}
    reaped = []
    for name in segments:
        match = _SEGMENT.match(name)
        if match is None or match["prefix"] != prefix:
            continue  # not ours (another prefix that starts like this one, or a foreign file)
        owner = match["owner"]
        if owner in gone or owner not in leases:
            reaped += [name] if dry_run else _unlink(name)
    for owner in gone:
        reaped += [leases[owner]] if dry_run else _unlink(leases[owner])
    if reaped and not dry_run:
        logger.warning("reaped %d shared-memory files of %s whose owners are gone", len(reaped), prefix)
    return reaped


def prefixes_in_use() -> set[str]:
    """Every prefix with an HMM file or lease in /dev/shm (servers started with their own
    `--shm-prefix`, tests and benchmarks with random ones)."""
    out = set()
    for name in os.listdir(SHM_DIR):
        lease = _LEASE_NAME.match(name)
        prefix = lease["prefix"] if lease else segment_prefix(name)
        if prefix is not None:
            out.add(prefix)
    return out


def reap_all(dry_run: bool = False) -> list[str]:
    """`reap` every prefix in use: what dead owners left under any prefix (live owners' files
    are never touched, whatever their prefix)."""
    return [name for prefix in sorted(prefixes_in_use()) for name in reap(prefix, dry_run)]


def _unlink(name: str) -> list[str]:
    try:
        os.unlink(os.path.join(SHM_DIR, name))
    except FileNotFoundError:
        return []
    return [name]
