"""Private memory of the instance ranks on this machine, sampled while a scale runs.

The HMM accounts for device memory (weights, KV pools: shared memory every rank maps); what a rank
process holds privately is not in it. For the native engine that is little (its weights and KV
are the HMM's). A vLLM rank holds what vLLM's CPU backend repacks (linear and expert weights),
its own KV cache and vLLM's runtime, so a benchmark of the vLLM backend reports it beside the
HMM's peak: the sum of `RssAnon` (private resident memory; mapped shared memory is `RssShmem`)
over every process titled as a rank actor (`ray::InstanceRank...`), old, new and standby alike,
that descends from this process (the benchmark starts its Ray cluster, so its ranks are its
descendants; other servers on a shared machine are not counted).
"""

from __future__ import annotations

import os
import threading
from pathlib import Path

RANK_TITLE = b"ray::InstanceRank"


def _parents(proc: Path) -> dict[int, int]:
    """pid -> parent pid of every process."""
    parents = {}
    for entry in proc.iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            parents[int(entry.name)] = int(stat.rsplit(")", 1)[1].split()[1])  # after "(comm)": state, ppid
    return parents


def _descends(pid: int, root: int, parents: dict[int, int]) -> bool:
    while pid > 1:
        if pid == root:
            return True
        pid = parents.get(pid, 0)
    return False


def rank_private_bytes(root_pid: int | None = None, proc: Path = Path("/proc")) -> int:
    """Sum of RssAnon over the rank processes descending from `root_pid` (default: this one)."""
    root = os.getpid() if root_pid is None else root_pid
    parents = _parents(proc)
    total = 0
    for pid in parents:
        entry = proc / str(pid)
        try:
            if not (entry / "cmdline").read_bytes().startswith(RANK_TITLE) or not _descends(pid, root, parents):
                continue
            for line in (entry / "status").read_text().splitlines():
                if line.startswith("RssAnon:"):
                    total += int(line.split()[1]) * 1024
                    break
        except OSError:  # the process ended meanwhile
            continue
    return total


class RankMemorySampler:
    """Samples `rank_private_bytes` every `interval_s` in a thread; `peak()` since the last `reset`."""

    def __init__(self, interval_s: float = 0.05) -> None:
        self.interval_s = interval_s
        self._peak = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rank-memory", daemon=True)

    def __enter__(self) -> RankMemorySampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            now = rank_private_bytes()
            with self._lock:
                self._peak = max(self._peak, now)

    def reset(self) -> int:
        """Start a new peak from the current value; returns that value."""
        now = rank_private_bytes()
        with self._lock:
            self._peak = now
        return now

    def peak(self) -> int:
        with self._lock:
            return max(self._peak, rank_private_bytes())
