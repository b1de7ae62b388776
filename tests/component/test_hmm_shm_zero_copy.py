"""Zero-copy across processes: a handle opened in a spawned process maps the
owner's pages — writes cross both ways, opening costs no memory, and touching
the pages adds shared (not private) resident memory."""

from __future__ import annotations

import multiprocessing as mp

import torch

from hmm.memory import MemoryAccount, ShmBackend, TensorHandle, list_segments, open_tensor

MiB = 1024 * 1024
SIZE = 32 * MiB


def _rss_kib() -> dict[str, int]:
    """RssAnon / RssFile / RssShmem of this process (kB, from /proc/self/status)."""
    out: dict[str, int] = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("RssAnon", "RssFile", "RssShmem"):
                out[key] = int(value.split()[0])
    return out


def _reader(conn) -> None:
    handle: TensorHandle = conn.recv()
    torch.zeros(1).sum()  # warm up torch's allocator and kernels before measuring
    before = _rss_kib()
    t = open_tensor(handle)
    after_open = _rss_kib()
    total = int(t.sum())  # touches every page (read)
    after_touch = _rss_kib()
    t[0] = -7  # write through to the owner's pages
    conn.send({"before": before, "after_open": after_open, "after_touch": after_touch, "sum": total})
    conn.recv()  # owner wrote t[1] and freed (unlinked) the allocation
    conn.send(int(t[1]))
    conn.close()


def test_zero_copy_across_processes(shm_prefix):
    backend = ShmBackend(MemoryAccount("d0", budget=64 * MiB), prefix=shm_prefix)
    t = backend.allocate((SIZE // 4,), torch.int32)
    t.copy_(torch.arange(t.numel(), dtype=torch.int32) % 1000)
    expected_sum = int(t.sum())

    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_reader, args=(child,))
    proc.start()
    try:
        parent.send(backend.export(t))
        assert parent.poll(120), "reader did not answer"
        stats = parent.recv()
        assert stats["sum"] == expected_sum  # the reader sees the owner's data
        assert int(t[0]) == -7  # ... and the owner sees the reader's write

        size_kib = SIZE // 1024
        opened = {k: stats["after_open"][k] - stats["before"][k] for k in stats["before"]}
        touched = {k: stats["after_touch"][k] - stats["after_open"][k] for k in stats["before"]}
        # opening a handle maps, it does not copy: resident memory barely moves
        assert sum(opened.values()) < size_kib // 8, opened
        # touching makes the *shared* pages resident; no private copy appears
        assert touched["RssShmem"] >= size_kib * 9 // 10, touched
        assert touched["RssAnon"] < size_kib // 8, touched

        t[1] = 4242
        backend.free(t)
        assert list_segments(shm_prefix) == []  # unlinked while the reader still maps it
        parent.send("check")
        assert parent.poll(60)
        assert parent.recv() == 4242  # the reader's mapping outlives the free
    finally:
        proc.join(60)
        if proc.is_alive():
            proc.kill()
        backend.close_all()
    assert proc.exitcode == 0
