"""`elasticmoe.utils.ports.free_port`: ports from below the kernel's ephemeral range (where an
outgoing connection cannot take them before they are bound), a taken one skipped, and the kernel's
choice where there is no room."""

from __future__ import annotations

import socket

import pytest

from elasticmoe.utils import ports
from elasticmoe.utils.ports import free_port


def test_free_port_is_below_the_ephemeral_range_and_skips_a_taken_port(monkeypatch):
    monkeypatch.setattr(ports, "ephemeral_ports_start", lambda: 32768)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        candidates = iter([taken.getsockname()[1], 23456, 23457])
        monkeypatch.setattr(ports._random, "randrange", lambda lo, hi: next(candidates))
        port = free_port()
    assert port in (23456, 23457)  # 23456 unless something on this machine holds it
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))  # free indeed


def test_every_interface_and_the_range_the_kernel_reports():
    assert ports.PORTS_FROM <= free_port("") < ports.ephemeral_ports_start() or ports.ephemeral_ports_start() < 21000


def test_free_port_falls_back_to_the_kernels_choice_without_room_below_the_range(monkeypatch):
    monkeypatch.setattr(ports, "ephemeral_ports_start", lambda: 20100)
    monkeypatch.setattr(ports._random, "randrange", lambda lo, hi: pytest.fail("no room: not used"))
    assert 0 < free_port() < 65536
