"""A free TCP port that stays free until its user binds it.

Whoever asks for a port here binds it later: a benchmark's or test's server, the gloo store of a
device group (`hmm.worker`) or of an instance's EP group (`imm.rank`). A port the kernel hands out
for `bind(0)` comes from its ephemeral range, which outgoing connections draw their local ends
from too (Ray opens many while a server or a group starts), so it may be taken before it is bound:
a test's server once failed that way (`Address already in use`). Ports are picked from below that
range instead, where only listeners live, with the kernel's choice as the fallback.
"""

from __future__ import annotations

import random
import socket

PORTS_FROM = 20000  # above Ray's worker ports (10002-19999 by default)
_random = random.SystemRandom()  # not the global generator: tests seed it, and processes would collide


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nothing listens on at `host` ("" for every interface), below the ephemeral
    range where there is room."""
    below = ephemeral_ports_start()
    for _ in range(64 if below - PORTS_FROM >= 1000 else 0):
        with socket.socket() as s:
            try:
                s.bind((host, _random.randrange(PORTS_FROM, below)))
            except OSError:
                continue
            return int(s.getsockname()[1])
    with socket.socket() as s:  # the kernel's choice, from the ephemeral range
        s.bind((host, 0))
        return int(s.getsockname()[1])


def ephemeral_ports_start() -> int:
    """The first port of the kernel's ephemeral range (Linux's default where it cannot be read)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768
