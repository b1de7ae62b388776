"""p2p-copy between device workers: a gloo group, plus the same-node fast path.

Gloo path: the device workers form one `torch.distributed` gloo group (rank =
registry order). A batch of copies is a list of `Transfer`s per worker; every
worker posts all its sends and receives non-blocking, then waits for all, so any
pattern of pairs (a worker sending to one peer while receiving from another)
completes without deadlock. Bytes travel as `uint8` views of contiguous buffers.

Adding a device rebuilds the group (paper D.6): every worker destroys its group
and joins a new one with the new world size at a fresh TCP port (a new store),
so no message of the old group can reach the new one. Each member's gloo sockets are on
the interface of its node's address (`init_gloo`), never where the hostname happens to resolve.

Fast path (same node): the destination opens the source's handle — the same
physical pages — and copies between the two mappings; no bytes cross a socket.
"""

from __future__ import annotations

import fcntl
import logging
import os
import socket
import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Literal

import torch
import torch.distributed as dist

from hmm.layout import TensorKey
from hmm.memory import TensorHandle, VirtualTensorHandle, open_tensor, open_virtual_tensor

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class GroupSpec:
    """One incarnation of the device workers' gloo group."""

    world_size: int
    master_addr: str
    port: int
    epoch: int

    @property
    def init_method(self) -> str:
        return f"tcp://{self.master_addr}:{self.port}"


@dataclass(frozen=True, slots=True)
class Transfer:
    """One side of a gloo copy of `key`: `op` with group rank `peer`, matched by `tag`."""

    op: Literal["send", "recv"]
    peer: int
    tag: int
    key: TensorKey


@dataclass(frozen=True, slots=True)
class HandleCopy:
    """Fast path: fill this device's buffer of `key` from `source` (slot `slot` of a virtual tensor)."""

    key: TensorKey
    source: TensorHandle | VirtualTensorHandle
    slot: int | None = None


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """A flat `uint8` view of a contiguous tensor (no copy)."""
    if not t.is_contiguous():
        raise ValueError("p2p: buffers must be contiguous")
    return t.reshape(-1).view(torch.uint8)


_SIOCGIFADDR = 0x8915  # ioctl: an interface's IPv4 address


def interface_of(address: str) -> str | None:
    """The name of this host's (or network namespace's) interface whose IPv4 address is `address`."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            try:
                ifreq = fcntl.ioctl(s.fileno(), _SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
            except OSError:  # no IPv4 address
                continue
            if socket.inet_ntoa(ifreq[20:24]) == address:
                return name
    return None


def init_gloo(spec: GroupSpec, rank: int, address: str, timeout_s: float = 60.0) -> None:
    """Join `spec` as `rank` (the process's default `torch.distributed` group, gloo), its sockets
    on the interface that carries `address`: this process's node address, where its peers reach it.

    # NOTE: left alone, gloo binds where the hostname resolves, which is often 127.0.0.1
    # (/etc/hosts), and tells its peers to connect there: a peer on another node (another
    # network namespace) then reaches its own loopback, and the group never forms. An
    # operator's GLOO_SOCKET_IFNAME wins; the variable is read when the group is created.
    """
    if "GLOO_SOCKET_IFNAME" not in os.environ:
        name = interface_of(address)
        if name is not None:
            os.environ["GLOO_SOCKET_IFNAME"] = name
        else:
            logger.warning("gloo: no interface has %s; gloo binds where the hostname resolves", address)
    dist.init_process_group(
        "gloo",
        init_method=spec.init_method,
        rank=rank,
        world_size=spec.world_size,
        timeout=timedelta(seconds=timeout_s),
    )


class P2PGroup:
    """This worker's membership in the device group; `join` replaces any older group."""

    def __init__(self) -> None:
        self.spec: GroupSpec | None = None
        self.rank = -1

    @property
    def is_joined(self) -> bool:
        return self.spec is not None

    def join(self, spec: GroupSpec, rank: int, address: str, timeout_s: float = 60.0) -> None:
        """Leave the old group, join `spec` as `rank` from `address` (this node's). Blocks until
        all `world_size` joined."""
        self.leave()
        init_gloo(spec, rank, address, timeout_s)
        self.spec, self.rank = spec, rank
        logger.info("p2p group epoch %d: rank %d of %d", spec.epoch, rank, spec.world_size)

    def leave(self) -> None:
        if self.spec is not None and dist.is_initialized():
            dist.destroy_process_group()
        self.spec, self.rank = None, -1

    def run(self, transfers: Sequence[Transfer], buffer_of: Callable[[Transfer], torch.Tensor]) -> int:
        """Post every send/recv of `transfers`, then wait for all; return bytes moved here.

        # NOTE: all workers must run their part of one batch concurrently, with the
        # same tags on both sides; a worker missing from the batch hangs its peers
        # until the group timeout.
        """
        if self.spec is None:
            raise RuntimeError("p2p: not in a group (join first)")
        works, moved = [], 0
        for tr in transfers:
            buf = as_bytes(buffer_of(tr))
            post = dist.isend if tr.op == "send" else dist.irecv
            works.append(post(buf, tr.peer, tag=tr.tag))
            moved += buf.numel()
        for w in works:
            if w is not None:
                w.wait()
        return moved


def copy_from_handles(copies: Sequence[HandleCopy], buffer_of: Callable[[TensorKey], torch.Tensor]) -> int:
    """Same-node fast path: copy each source mapping into our buffer; return bytes copied."""
    opened: dict[TensorHandle | VirtualTensorHandle, torch.Tensor] = {}
    moved = 0
    for c in copies:
        src = opened.get(c.source)
        if src is None:
            if isinstance(c.source, VirtualTensorHandle):
                src = opened[c.source] = open_virtual_tensor(c.source)
            else:
                src = opened[c.source] = open_tensor(c.source)
        if c.slot is not None:
            src = src[c.slot]
        dst = buffer_of(c.key)
        if dst.shape != src.shape or dst.dtype != src.dtype:
            raise ValueError(
                f"p2p {c.key}: source {tuple(src.shape)}/{src.dtype} != {tuple(dst.shape)}/{dst.dtype}"
            )
        dst.copy_(src)
        moved += dst.numel() * dst.element_size()
    return moved
