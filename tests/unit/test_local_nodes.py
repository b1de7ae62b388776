"""The multi-node benchmarks' plumbing: `--nodes` parsing, a child run as the cluster's driver,
and the names of the namespaced nodes' interfaces."""

from __future__ import annotations

import sys

import pytest

from coordinator.bench.local_nodes import RayNodes, attached, parse_nodes, run_attached
from coordinator.bench.netns import NodeNetwork


def test_parse_nodes():
    assert parse_nodes("2,1") == (2, 1) and parse_nodes("0,1") == (0, 1)
    for bad in ("2", "a,b", "1,-1", "0,0", ""):
        with pytest.raises(ValueError, match="--nodes"):
            parse_nodes(bad)


def test_a_child_run_attached_carries_the_token_and_finds_its_cluster(tmp_path):
    """Ray reads its token mode on import, so a benchmark joins its nodes from a child process
    whose environment carries the token from the start, and `attached()` there names the cluster
    (and its namespaces, whose veths it reads)."""
    assert attached() is None
    network = NodeNetwork("0123ab", "10.213.7", ["emoe-0123ab-0"])
    nodes = RayNodes(str(tmp_path), "127.0.0.1:1234", {"PATH": "/usr/bin:/bin", "RAY_AUTH_MODE": "token",
                                                        "RAY_AUTH_TOKEN": "t0ken"}, network=network)
    module = tmp_path / "probe_child.py"
    module.write_text(
        "import os, sys\n"
        "from coordinator.bench.local_nodes import attached\n"
        "c = attached()\n"
        "ok = c.address == '127.0.0.1:1234' and c.temp_dir == sys.argv[1] and os.environ['RAY_AUTH_TOKEN'] == 't0ken'\n"
        "ok = ok and c.network.tag == '0123ab' and c.network.namespaces == ['emoe-0123ab-0']\n"
        "sys.exit(0 if ok else 3)\n")
    nodes.env["PYTHONPATH"] = f"{tmp_path}:{':'.join(p for p in sys.path if p)}"
    assert run_attached(nodes, "probe_child", [str(tmp_path)]) == 0
    assert run_attached(nodes, "probe_child", ["elsewhere"]) == 3  # the child's status is returned


def test_namespaced_nodes_interface_names_fit_linux_limit():
    """Linux names an interface in at most 15 characters; a /24 holds 253 namespaces."""
    network = NodeNetwork("0123ab", "10.213.7")
    names = [network.bridge, network.host_veth(252), network.ns_veth(252)]
    assert max(len(n) for n in names) <= 15 and len(set(names)) == 3
    assert network.bridge_address == "10.213.7.1" and network.interface_bytes() == {}
