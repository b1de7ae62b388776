"""gloo's sockets go on the interface of the node's address, not where the hostname resolves."""

from __future__ import annotations

from hmm.p2p import interface_of


def test_the_interface_of_an_address():
    assert interface_of("127.0.0.1") == "lo"
    assert interface_of("203.0.113.77") is None  # TEST-NET-3: on no interface of this host
