"""Network namespaces for the local Ray nodes (`ray_nodes(netns=True)`): a Linux bridge on the
host and, per worker node, a namespace joined to it by a veth pair.

    host:  bridge emoe<tag>b  10.213.X.1/24  <- the head, the driver, the server
             |- emoe<tag>h0 ==veth== emoe<tag>n0  10.213.X.2  in namespace emoe-<tag>-0
             |- emoe<tag>h1 ==veth== emoe<tag>n1  10.213.X.3  in namespace emoe-<tag>-1

A worker node then shares nothing network-wise with the host but the bridge: its loopback is
its own, and whatever it exchanges with another node (Ray's traffic, gloo's p2p copies)
crosses its veth, whose counters `interface_bytes` reads. The filesystem (and so /dev/shm)
stays shared, as the nodes' processes still run on one machine.

`<tag>` is six random hex digits and `X` a /24 no interface on the host uses yet, so two
clusters can coexist (interface names are at most 15 characters: `emoe` + 6 + `h` + index).
Creating namespaces needs root (CAP_NET_ADMIN and CAP_SYS_ADMIN): see `netns_unavailable`.
"""

from __future__ import annotations

import contextlib
import random
import secrets
import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

IP = shutil.which("ip") or "/usr/sbin/ip"
SUBNET_PREFIX = "10.213"  # the third octet is picked per cluster


def _ip(*args: str) -> str:
    out = subprocess.run([IP, *args], capture_output=True, text=True, timeout=30)
    if out.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {out.stderr.strip()}")
    return out.stdout


def netns_unavailable() -> str | None:
    """Why this process cannot build namespaced nodes (e.g. not root), or None if it can."""
    probe = f"emoe-probe-{secrets.token_hex(3)}"
    try:
        _ip("netns", "add", probe)
    except (OSError, RuntimeError, subprocess.TimeoutExpired) as exc:
        return f"cannot create a network namespace ({exc})"
    _ip("netns", "del", probe)
    return None


def _free_subnet() -> str:
    """A 10.213.X (/24) that no address on the host falls in."""
    used = _ip("-4", "-o", "addr", "show")
    free = [x for x in range(256) if f"inet {SUBNET_PREFIX}.{x}." not in used]
    if not free:
        raise RuntimeError(f"every {SUBNET_PREFIX}.X.0/24 is in use on this host")
    return f"{SUBNET_PREFIX}.{random.choice(free)}"


@dataclass
class NodeNetwork:
    """The bridge and the namespaces of one cluster. `namespaces[i]` has address `.{i + 2}`;
    names are recorded before the object is created, so `teardown` after a failure midway
    removes whatever exists."""

    tag: str
    subnet: str  # "10.213.X"
    namespaces: list[str] = field(default_factory=list)

    @classmethod
    def create(cls) -> NodeNetwork:
        """The bridge, up, with the subnet's first address. On failure nothing is left."""
        net = cls(secrets.token_hex(3), _free_subnet())
        try:
            _ip("link", "add", net.bridge, "type", "bridge")
            _ip("addr", "add", f"{net.bridge_address}/24", "dev", net.bridge)
            _ip("link", "set", net.bridge, "up")
        except BaseException:
            net.teardown()
            raise
        return net

    @property
    def bridge(self) -> str:
        return f"emoe{self.tag}b"

    @property
    def bridge_address(self) -> str:
        return f"{self.subnet}.1"

    def host_veth(self, index: int) -> str:
        return f"emoe{self.tag}h{index}"

    def ns_veth(self, index: int) -> str:
        return f"emoe{self.tag}n{index}"

    def add_namespace(self) -> tuple[str, str]:
        """A new namespace wired to the bridge: (its name, its address). Its `lo` is up, as Ray's
        processes on one node talk over 127.0.0.1."""
        index = len(self.namespaces)
        if index > 252:
            raise RuntimeError("a /24 holds at most 253 namespaces")
        ns, host_end, ns_end = f"emoe-{self.tag}-{index}", self.host_veth(index), self.ns_veth(index)
        address = f"{self.subnet}.{index + 2}"
        self.namespaces.append(ns)
        _ip("netns", "add", ns)
        _ip("link", "add", host_end, "type", "veth", "peer", "name", ns_end)
        _ip("link", "set", host_end, "master", self.bridge)
        _ip("link", "set", host_end, "up")
        _ip("link", "set", ns_end, "netns", ns)
        _ip("-n", ns, "addr", "add", f"{address}/24", "dev", ns_end)
        _ip("-n", ns, "link", "set", ns_end, "up")
        _ip("-n", ns, "link", "set", "lo", "up")
        return ns, address

    @staticmethod
    def exec_in(ns: str) -> list[str]:
        """The command prefix that runs a program in namespace `ns`."""
        return [IP, "netns", "exec", ns]

    def interface_bytes(self) -> dict[str, int]:
        """Bytes each namespace's veth carried so far, both directions: {host-side veth: bytes}.
        A veth that is gone (its namespace deleted) is left out."""
        out = {}
        for index in range(len(self.namespaces)):
            stats = Path("/sys/class/net") / self.host_veth(index) / "statistics"
            with contextlib.suppress(FileNotFoundError):
                out[self.host_veth(index)] = int((stats / "rx_bytes").read_text()) + int(
                    (stats / "tx_bytes").read_text())
        return out

    def leftovers(self) -> list[str]:
        """This cluster's namespaces and interfaces that still exist (after `teardown`: none)."""
        names = [line.split()[0] for line in _ip("netns", "list").splitlines() if line.strip()]
        links = [line.split(":")[1].strip().split("@")[0] for line in _ip("-o", "link", "show").splitlines()]
        return [n for n in names + links if self.tag in n]

    def teardown(self) -> None:
        """Delete the namespaces (with them their veth ends, and so the pairs), any host-side veth
        left, then the bridge. Run it once no process is left in the namespaces: a namespace a
        process still holds outlives its name, with its veth."""
        for index, ns in enumerate(self.namespaces):
            for args in (("netns", "del", ns), ("link", "del", self.host_veth(index))):
                with contextlib.suppress(RuntimeError):
                    _ip(*args)
        with contextlib.suppress(RuntimeError):
            _ip("link", "del", self.bridge)
