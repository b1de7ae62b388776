"""Shared-memory leases: files outlive a killed owner only until the next reap; live owners' never."""

from __future__ import annotations

import os
import secrets
import signal
import subprocess
import sys
import textwrap

import pytest
import torch

from hmm.memory import MemoryAccount, ShmBackend, list_segments
from hmm.memory.lease import prefixes_in_use, reap, reap_all
from hmm.memory.page_pool import PagePool

KiB = 1024


@pytest.fixture
def prefix():
    prefix = f"emoetest{secrets.token_hex(4)}"
    yield prefix
    reap(prefix)
    assert list_segments(prefix) == [], "shared-memory files leaked"


def _owner_process(prefix: str) -> subprocess.Popen:
    """A process that allocates a tensor and a page pool under `prefix`, says so, and waits."""
    code = textwrap.dedent(f"""
        import sys, time, torch
        from hmm.memory import MemoryAccount, ShmBackend
        from hmm.memory.page_pool import PagePool
        account = MemoryAccount("d0", 1 << 20)
        backend = ShmBackend(account, prefix={prefix!r})
        t = backend.allocate((1024,), torch.float32)
        pool = PagePool(account, 64 * 1024, num_pages=4, prefix={prefix!r})
        pool.allocate(2)
        print("ready", flush=True)
        time.sleep(60)
    """)
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True,
                            cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__))))
    assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
    return proc


def test_files_of_a_killed_owner_are_reaped_and_a_live_owners_are_not(prefix):
    proc = _owner_process(prefix)
    try:
        theirs = list_segments(prefix)
        assert len(theirs) == 3 and sum("-lease-" in n for n in theirs) == 1  # tensor, pool, lease
        assert reap(prefix) == []  # the owner lives: nothing is touched
        mine = ShmBackend(MemoryAccount("d1", 1 << 20), prefix=prefix)
        kept = mine.allocate((16,), torch.float32)
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
        reaped = reap(prefix)
        assert sorted(reaped) == sorted(theirs)  # everything of the dead owner, its lease included
        assert [n for n in list_segments(prefix) if "-lease-" not in n] == mine.names()
        mine.free(kept)
        assert list_segments(prefix) == []  # the last free of this process ended its lease too
    finally:
        proc.kill()


def test_a_file_whose_lease_is_gone_is_reaped(prefix):
    backend = ShmBackend(MemoryAccount("d0", 1 << 20), prefix=prefix)
    backend.allocate((16,), torch.float32)
    lease_file = next(n for n in list_segments(prefix) if "-lease-" in n)
    os.unlink(os.path.join("/dev/shm", lease_file))  # as if its owner's lease was reaped already
    assert reap(prefix) == backend.names()
    backend.close_all()  # the files are gone already: closing is still clean


def test_orderly_close_leaves_nothing_and_other_prefixes_are_untouched(prefix):
    other = prefix + "x"
    account = MemoryAccount("d0", 1 << 20)
    pool = PagePool(account, 64 * KiB, num_pages=2, prefix=other)
    backend = ShmBackend(account, prefix=prefix)
    backend.allocate((16,), torch.float32)
    assert reap(prefix) == [] and reap(other) == []
    backend.close_all()
    assert list_segments(prefix) == []
    pool.close()
    assert list_segments(other) == []


def test_reap_shm_command_lists_then_frees_only_dead_owners_files(prefix, capsys):
    from elasticmoe.cli import main

    proc = _owner_process(prefix)
    mine = ShmBackend(MemoryAccount("d1", 1 << 20), prefix=prefix)
    kept = mine.allocate((16,), torch.float32)
    try:
        theirs = [n for n in list_segments(prefix) if f"-{proc.pid}o" in n]
        assert main(["reap-shm", "--prefix", prefix, "--dry-run"]) == 0
        assert capsys.readouterr().out.split() == []  # its owner lives
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
        assert main(["reap-shm", "--prefix", prefix, "--dry-run"]) == 0
        assert sorted(capsys.readouterr().out.split()) == sorted(theirs)
        assert set(theirs) <= set(list_segments(prefix))  # a dry run frees nothing
        assert main(["reap-shm", "--prefix", prefix]) == 0
        assert sorted(capsys.readouterr().out.split()) == sorted(theirs)
        assert not set(theirs) & set(list_segments(prefix)) and mine.names()  # ours untouched
        assert main(["reap-shm", "--all", "--dry-run"]) == 0
        assert not set(capsys.readouterr().out.split()) & set(mine.names())
    finally:
        proc.kill()
        mine.free(kept)


def test_reap_all_frees_dead_owners_under_every_prefix_and_nothing_live(prefix):
    other = f"emoetest{secrets.token_hex(4)}"
    dead = _owner_process(other)
    live = _owner_process(prefix)
    try:
        theirs, kept = list_segments(other), list_segments(prefix)
        assert {other, prefix} <= prefixes_in_use()
        dead.send_signal(signal.SIGKILL)
        dead.wait(10)
        assert sorted(n for n in reap_all(dry_run=True) if n.startswith(f"{other}-")) == sorted(theirs)
        reaped = reap_all()
        assert sorted(n for n in reaped if n.startswith(f"{other}-")) == sorted(theirs)
        assert not [n for n in reaped if n.startswith(f"{prefix}-")]  # a live owner's: untouched
        assert list_segments(other) == [] and list_segments(prefix) == kept
    finally:
        dead.kill()
        live.kill()
        live.wait(10)
