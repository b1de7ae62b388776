"""The multi-node benchmarks' plumbing: `--nodes` parsing, and a child run as the cluster's driver."""

from __future__ import annotations

import sys

import pytest

from coordinator.bench.local_nodes import RayNodes, attached, parse_nodes, run_attached


def test_parse_nodes():
    assert parse_nodes("2,1") == (2, 1) and parse_nodes("0,1") == (0, 1)
    for bad in ("2", "a,b", "1,-1", "0,0", ""):
        with pytest.raises(ValueError, match="--nodes"):
            parse_nodes(bad)


def test_a_child_run_attached_carries_the_token_and_finds_its_cluster(tmp_path):
    """Ray reads its token mode on import, so a benchmark joins its nodes from a child process
    whose environment carries the token from the start, and `attached()` there names the cluster."""
    assert attached() is None
    nodes = RayNodes(str(tmp_path), "127.0.0.1:1234", {"PATH": "/usr/bin:/bin", "RAY_AUTH_MODE": "token",
                                                        "RAY_AUTH_TOKEN": "t0ken"})
    module = tmp_path / "probe_child.py"
    module.write_text(
        "import os, sys\n"
        "from coordinator.bench.local_nodes import attached\n"
        "c = attached()\n"
        "ok = c.address == '127.0.0.1:1234' and c.temp_dir == sys.argv[1] and os.environ['RAY_AUTH_TOKEN'] == 't0ken'\n"
        "sys.exit(0 if ok else 3)\n")
    nodes.env["PYTHONPATH"] = f"{tmp_path}:{':'.join(p for p in sys.path if p)}"
    assert run_attached(nodes, "probe_child", [str(tmp_path)]) == 0
    assert run_attached(nodes, "probe_child", ["elsewhere"]) == 3  # the child's status is returned
