"""`RankProcessPool`: the processes of retired instances' ranks, kept for the next instance.

A rank's process costs ~3 CPU-seconds to start (interpreter, Ray worker, torch import), on the
critical path of a scale that finds no standby instance; a scale-up followed by a scale-down
starts them again for nothing, since the retired instance's processes sit on the same nodes.
So when an instance retires and every one of its ranks shut down cleanly, `give` keeps up to
`capacity` of its processes (the newest), and `Instance.create_standby` takes one on the node a
new rank must run on: the process becomes that rank (`InstanceRank.reuse`, which refuses unless
the old engine left no device memory mapped). Anything that fails on that path kills the process
instead; a process is never reused half-cleaned. The native backend only: vLLM keeps global
state per process.

Thread-safe: instances are created and retired on several threads (scaler, standby boots).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import ray

from elasticmoe.errors import describe_error

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class PooledProcess:
    actor: Any  # an `InstanceRankActor` that shut down
    node: str  # its Ray node (hex id)
    pid: int


class RankProcessPool:
    """At most `capacity` idle rank processes; the most recently given is taken first."""

    def __init__(self, capacity: int = 2, timeout_s: float = 10.0) -> None:
        if capacity < 0:
            raise ValueError(f"capacity: must be >= 0, got {capacity}")
        self.capacity, self.timeout_s = capacity, timeout_s
        self.num_given = self.num_taken = self.num_killed = 0
        self._idle: list[PooledProcess] = []  # oldest first
        self._closed = False
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._idle)

    def take(self, node: str | None) -> PooledProcess | None:
        """An idle process on `node` (None: on any node), removed from the pool; None if there is none."""
        with self._lock:
            for i in range(len(self._idle) - 1, -1, -1):
                if node is None or self._idle[i].node == node:
                    self.num_taken += 1
                    return self._idle.pop(i)
        return None

    def give(self, ranks: Sequence[Any]) -> list[bool]:
        """Keep the processes of `ranks` (which shut down cleanly), up to the capacity; the rest,
        and any that cannot tell where it runs, are killed. Returns, per rank, whether it was kept."""
        where: list[dict[str, Any] | None] = [None] * len(ranks)
        if ranks and self.capacity and not self._closed:
            try:
                where = list(ray.get([r.where.remote() for r in ranks], timeout=self.timeout_s))
            except Exception as exc:  # noqa: BLE001 - a rank that cannot answer is killed below
                logger.warning("rank processes: not kept, where they run is unknown (%s)", describe_error(exc))
        kept = [False] * len(ranks)
        evicted: list[Any] = []
        with self._lock:
            for i, (rank, w) in enumerate(zip(ranks, where, strict=True)):
                if w is not None and not self._closed:
                    self._idle.append(PooledProcess(rank, w["ray_node_id"], w["pid"]))
                    kept[i] = True
                    self.num_given += 1
            while len(self._idle) > self.capacity:
                evicted.append(self._idle.pop(0).actor)
        self._kill([r for r, k in zip(ranks, kept, strict=True) if not k] + evicted)
        return [k and not any(r is e for e in evicted) for r, k in zip(ranks, kept, strict=True)]

    def discard(self, process: PooledProcess) -> None:
        """Kill a taken process that could not be reused."""
        self._kill([process.actor])

    def drop_node(self, node: str) -> int:
        """Kill the idle processes on `node` (it leaves the cluster); returns how many."""
        with self._lock:
            gone = [p for p in self._idle if p.node == node]
            self._idle = [p for p in self._idle if p.node != node]
        self._kill([p.actor for p in gone])
        return len(gone)

    def close(self) -> None:
        """Kill every idle process; processes given later are killed at once."""
        with self._lock:
            self._closed = True
            gone, self._idle = self._idle, []
        self._kill([p.actor for p in gone])

    def status(self) -> dict[str, Any]:
        with self._lock:
            idle = [{"pid": p.pid, "ray_node_id": p.node} for p in self._idle]
        return {"capacity": self.capacity, "idle": idle, "reused": self.num_taken, "kept": self.num_given,
                "killed": self.num_killed}

    def _kill(self, actors: Sequence[Any]) -> None:
        for actor in actors:
            self.num_killed += 1
            try:
                ray.kill(actor)
            except Exception:  # noqa: BLE001 - already gone
                pass
