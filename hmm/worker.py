"""`DeviceWorker`: the data plane of one device (wraps `DeviceMemory` + p2p).

A plain class, so it is testable in-process; `DeviceWorkerActor` is the same
class as a Ray actor, one per device, reserving no whole CPU (several fit on a
2-core machine). Every method is a message from the controller; methods run one
at a time per worker (Ray's sync actor), so `DeviceMemory` needs no locks.

Lifecycle: construct -> (join_group)* -> begin / fill / commit | abort ... -> shutdown;
`clear` frees the device's tensors between models (the worker, its page pool and
its group stay).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from pathlib import Path

import ray
import torch

from elasticmoe.models.weights import ParamSpec
from elasticmoe.utils.ports import free_port
from hmm.device_memory import DEVICE_PAGE_SIZE, AdapterRow, DeviceMemory, Handle
from hmm.layout import DeviceSpec, TensorKey
from hmm.lifeline import in_ray_actor, watch_parent
from hmm.memory import MemoryUsage
from hmm.memory.lease import reap
from hmm.memory.page_table import SlotPages
from hmm.memory.segments import DEFAULT_PREFIX
from hmm.p2p import GroupSpec, HandleCopy, P2PGroup, Transfer, copy_from_handles
from hmm.placement import node_address, ray_node_id
from hmm.transition_options import DEFAULT_OPTIONS, TransitionOptions

logger = logging.getLogger(__name__)


class InjectedFailure(RuntimeError):
    """Raised by a worker method armed with `fail_next` (tests of rollback)."""


class DeviceWorker:
    """One device: its memory, its p2p endpoint, and failure injection for tests."""

    def __init__(
        self, spec: DeviceSpec, page_size: int = DEVICE_PAGE_SIZE, prefix: str = DEFAULT_PREFIX
    ) -> None:
        torch.set_num_threads(1)
        self.spec = spec
        # A worker that replaces a dead one (or a restarted coordinator's) frees its predecessor's
        # memory first: files whose owner process is gone (`hmm.memory.lease`).
        self.prefix = prefix
        self.reap()
        self.memory = DeviceMemory(spec.device_id, spec.budget_bytes, page_size, prefix)
        if in_ray_actor():  # its files must not outlive the node's raylet (see hmm.lifeline)
            watch_parent(self.memory.close)
        self.group = P2PGroup()
        self._fail: set[str] = set()

    def _check(self, method: str) -> None:
        if method in self._fail:
            self._fail.discard(method)
            raise InjectedFailure(f"device {self.spec.device_id}: injected failure in {method}")

    # ---- lifecycle -------------------------------------------------------------------

    def check_health(self) -> dict[str, object]:
        return {
            "device_id": self.spec.device_id,
            "pid": os.getpid(),
            "ray_node_id": ray_node_id(),
            "group_epoch": self.group.spec and self.group.spec.epoch,
        }

    def reap(self) -> list[str]:
        """Unlink this node's /dev/shm files of our prefix whose owner process is gone."""
        return reap(self.prefix)

    def node_address(self) -> str:
        return node_address()

    def free_port(self) -> int:
        """A free TCP port on this node (for the group store this worker hosts as rank 0)."""
        return free_port("")

    def join_group(self, group: GroupSpec, rank: int) -> int:
        self.group.join(group, rank, node_address())
        return group.epoch

    def clear(self) -> None:
        """Free every tensor of the device (current and staged); stay ready for a new load."""
        self.memory.clear()

    def shutdown(self) -> None:
        """Leave the group and free every byte of the device (no /dev/shm file left)."""
        self.group.leave()
        self.memory.close()

    def fail_next(self, method: str) -> None:
        """Arm a one-shot failure of `method` (tests)."""
        self._fail.add(method)

    # ---- transitions -----------------------------------------------------------------

    def begin(
        self,
        specs: Sequence[ParamSpec],
        dtype: torch.dtype,
        kv_bytes: int,
        options: TransitionOptions = DEFAULT_OPTIONS,
        adapter_rows: Sequence[AdapterRow] = (),
        cache_bytes: int = 0,
        host_experts: bool = True,
    ) -> list[TensorKey]:
        self._check("begin")
        return self.memory.begin(specs, dtype, kv_bytes, options, adapter_rows, cache_bytes, host_experts)

    def map_adapter_rows(self, rows: Sequence[AdapterRow]) -> dict[str, list[SlotPages]]:
        self._check("map_adapter_rows")
        return self.memory.map_adapter_rows(rows)

    def unmap_adapter_rows(self, rows: Sequence[tuple[str, int]]) -> int:
        return self.memory.unmap_adapter_rows(rows)

    def local_copy(self, keys: Sequence[TensorKey]) -> int:
        """Fill staged buffers of kept tensors from this device's current ones."""
        self._check("local_copy")
        return self.memory.local_copy(keys)

    def load_from_disk(self, model_dir: str | Path, specs: Sequence[ParamSpec], dtype: torch.dtype) -> int:
        self._check("load_from_disk")
        return self.memory.load_from_disk(model_dir, specs, dtype)

    def run_transfers(self, transfers: Sequence[Transfer]) -> int:
        """This worker's part of a gloo batch: sends read filled buffers, receives fill staged ones."""
        self._check("run_transfers")

        def buffer_of(tr: Transfer) -> torch.Tensor:
            return self.memory.readable(tr.key) if tr.op == "send" else self.memory.writable(tr.key)

        return self.group.run(transfers, buffer_of)

    def source_handles(self, keys: Sequence[TensorKey]) -> list[tuple[Handle, int | None]]:
        return [self.memory.source_handle(k) for k in keys]

    def copy_from_handles(self, copies: Sequence[HandleCopy]) -> int:
        self._check("copy_from_handles")
        return copy_from_handles(copies, self.memory.writable)

    def commit(self) -> int:
        return self.memory.commit()

    def abort(self) -> None:
        self.memory.abort()

    # ---- inspection ------------------------------------------------------------------

    def export_handles(self, staged: bool = False) -> dict[str, Handle]:
        return self.memory.export_handles(staged)

    def usage(self) -> MemoryUsage:
        return self.memory.usage()

    def host_usage(self) -> MemoryUsage:
        return self.memory.host_usage()

    def reset_peak(self) -> None:
        self.memory.account.reset_peak()

    def read(self, key: TensorKey) -> torch.Tensor:
        """A private copy of a held tensor (tests and debugging)."""
        return self.memory.readable(key).clone()

    def write(self, key: TensorKey, value: torch.Tensor) -> None:
        """Fill a buffer (tests and debugging)."""
        self.memory.writable(key).copy_(value)


# No CPU reserved, so one node (even a 2-core one) hosts many devices; one method at a time.
DeviceWorkerActor = ray.remote(num_cpus=0)(DeviceWorker)
