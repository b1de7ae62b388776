"""The disk tier reads the checkpoint with `pread`: a file cut short under the server (a checkpoint
copied over in place) fails the copies past its new end with an error, on the forward thread, on the
native copy thread and in a load the two share, and the cache serves on. Through a mapping, the
same copy would have faulted the process (SIGBUS)."""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import pytest
import torch
from offload_factories import bf16_disk_experts

from elasticmoe.engine.expert_cache import ExpertCache
from elasticmoe.engine.expert_copier import NativeCopier, make_copier
from elasticmoe.kernels import copy_engine
from elasticmoe.kernels.copy_engine import MEMCPY, READ_FILE, READ_FILE_BF16_TO_F32, CopyEngine
from elasticmoe.offload import PolicyConfig, make_policy

needs_copy_engine = pytest.mark.skipif(not copy_engine.available(), reason="no C++ compiler for the copy engine")


def cut_before(path: Path, prefix: str) -> None:
    """Truncate the safetensors file `path` where its first tensor named `prefix...` starts: every
    tensor of that prefix (and any stored after it) is gone, the ones before it are intact."""
    with open(path, "rb") as f:
        (header_len,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(header_len))
    begins = [8 + header_len + e["data_offsets"][0] for name, e in header.items() if name.startswith(prefix)]
    os.truncate(path, min(begins))


def test_the_forward_threads_copy_past_the_end_raises_and_one_before_it_reads(tmp_path):
    names, disk, _, _ = bf16_disk_experts(tmp_path)
    w13, w2 = torch.empty(6, 4), torch.empty(3, 4)
    cut_before(tmp_path / "model.safetensors", "e1.")
    with pytest.raises(OSError, match="bytes before this expert does"):
        disk.copy_into(0, 1, w13, w2)
    disk.copy_into(0, 0, w13, w2)  # expert 0 lies before the cut
    assert torch.equal(w13, torch.cat([names["e0.gate"], names["e0.up"]]).float())
    assert torch.equal(w2, names["e0.down"].float())


@needs_copy_engine
def test_the_copy_engine_reads_files_exactly_and_reports_a_short_read(tmp_path):
    f32, bf16 = torch.randn(64), torch.randn(64).bfloat16()
    path = tmp_path / "parts.bin"
    path.write_bytes(f32.numpy().tobytes() + bf16.view(torch.int16).numpy().tobytes())
    fd = os.open(path, os.O_RDONLY)
    try:
        table = torch.zeros(2, 1, copy_engine.SEGMENT_FIELDS, dtype=torch.int64).numpy()
        table[0, 0] = (fd, 0, 0, f32.nbytes, READ_FILE, 0)
        table[1, 0] = (fd, 0, 0, bf16.numel(), READ_FILE_BF16_TO_F32, f32.nbytes)
        pool = torch.zeros(3, 64)
        engine = CopyEngine(table, [pool])
        first = engine.submit([(0, 0), (1, 1)])
        assert engine.wait(first + 1) and engine.take_failed() == []
        assert torch.equal(pool[0], f32) and torch.equal(pool[1], bf16.float())
        os.truncate(path, f32.nbytes + 10)  # the bf16 part is cut short
        second = engine.submit([(1, 2), (0, 0)])
        assert engine.wait(second + 1) and engine.finished() == second + 2  # a failed copy still finishes
        assert engine.take_failed() == [second] and engine.take_failed() == []
        assert torch.equal(pool[0], f32)  # the copy after it went on
        engine.close()
        bad = table.copy()
        bad[0, 0, 0] = -1  # no file
        with pytest.raises(ValueError, match="negative file"):
            CopyEngine(bad, [pool])
        bad[0, 0] = (0, 0, 0, 4, MEMCPY + 7, 0)  # no such kind
        with pytest.raises(ValueError, match="unknown pool or kind"):
            CopyEngine(bad, [pool])
    finally:
        os.close(fd)


@needs_copy_engine
def test_the_native_copier_reports_a_prefetch_past_the_end_as_failed(tmp_path):
    _, disk, _, _ = bf16_disk_experts(tmp_path)
    pool13, pool2 = torch.zeros(2, 6, 4), torch.zeros(2, 3, 4)
    copier = make_copier(disk, pool13, pool2, num_layers=1, num_local=2)
    assert isinstance(copier, NativeCopier)
    try:
        cut_before(tmp_path / "model.safetensors", "e1.")
        first = copier.submit([(0, 1, 0), (0, 0, 1)])
        assert copier.wait(first + 1)
        assert copier.finished() == first + 2 and copier.failed == {first}
        want13, want2 = torch.empty(6, 4), torch.empty(3, 4)
        disk.copy_into(0, 0, want13, want2)
        assert torch.equal(pool13[1], want13) and torch.equal(pool2[1], want2)
    finally:
        copier.close()


@needs_copy_engine
def test_a_shared_load_whose_copier_half_fails_fails_and_the_cache_serves_on(tmp_path):
    """An on-demand load of both experts gives the copier (polling on a core of its own) the second:
    that read fails, so the load raises once both rows are written, both experts stay out with
    their rows free, and a load of the expert before the cut works."""
    _, disk, _, _ = bf16_disk_experts(tmp_path)
    pool13, pool2 = torch.zeros(2, 6, 4), torch.zeros(2, 3, 4)
    copier = make_copier(disk, pool13, pool2, num_layers=1, num_local=2, poll_us=200_000)
    assert copier.polls
    policy = make_policy("on_demand", PolicyConfig(num_layers=1, num_experts=2, top_k=1))
    cache = ExpertCache(policy, disk, pool13, pool2, (0, 1), 1, 2, copier=copier)
    try:
        cut_before(tmp_path / "model.safetensors", "e1.")
        with pytest.raises(OSError, match=r"experts \[\(0, 1\)\] from the disk tier"):
            cache.ensure(0, [0, 1])
        assert cache.state.num_free == 2 and sorted(cache._free) == [0, 1] and not copier.failed
        cache.check_integrity()
        with pytest.raises(OSError, match=r"\(0, 1\)\]? from the disk tier"):
            cache.ensure(0, [1])  # alone: this thread and the copier read a half each, and both fail
        assert cache.state.num_free == 2 and not copier.failed and copier.running() == -1
        cache.check_integrity()
        row = cache.ensure(0, [0])[0]
        want13, want2 = torch.empty(6, 4), torch.empty(3, 4)
        disk.copy_into(0, 0, want13, want2)
        assert torch.equal(pool13[row], want13) and torch.equal(pool2[row], want2)
        assert cache.stats()["on_demand_loads"] == 1
    finally:
        cache.close()
