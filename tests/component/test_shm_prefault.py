"""A KV pool faulted in ahead of the engine's writes (`shm.prefault`): the opening process's
mapping becomes resident with its content unchanged, a kernel that refuses leaves it as it was,
and a range that is not mapped fails loudly."""

from __future__ import annotations

import logging

import pytest
import torch

from elasticmoe.engine.kv_cache import KVCacheSpec
from hmm.memory import MemoryAccount, ShmBackend, open_tensor
from hmm.memory import shm as shm_module
from hmm.memory.libc import PAGE_SIZE, munmap_raw, populate_write, reserve
from hmm.providers import HandleKVProvider

MiB = 1 << 20
SIZE = 16 * MiB


def _mapping_rss_kib(tensor: torch.Tensor) -> int:
    """Resident kB of the mapping (VMA) that holds `tensor`'s first byte in this process."""
    ptr = tensor.data_ptr()
    inside = False
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            head = line.split()[0]
            if "-" in head and all(c in "0123456789abcdef-" for c in head):
                start, end = (int(x, 16) for x in head.split("-"))
                inside = start <= ptr < end
            elif inside and line.startswith("Rss:"):
                return int(line.split()[1])
    raise AssertionError("no mapping holds the tensor")


def test_prefault_makes_the_mapping_resident_and_keeps_its_content(shm_prefix):
    backend = ShmBackend(MemoryAccount("d0", budget=64 * MiB), prefix=shm_prefix)
    try:
        owner = backend.allocate((SIZE,), torch.uint8)
        owner[:PAGE_SIZE].fill_(7)  # a pool handed over with its KV keeps it
        owner[-1] = 9
        opened = open_tensor(backend.export(owner))  # a second mapping, as the rank's
        assert _mapping_rss_kib(opened) < 64  # untouched: nothing resident in it yet

        shm_module.prefault(opened, "test pool").join(30)

        assert _mapping_rss_kib(opened) >= SIZE // 1024 * 9 // 10
        assert (opened[:PAGE_SIZE] == 7).all() and int(opened[-1]) == 9
        assert int(opened[PAGE_SIZE:-1].sum()) == 0
        opened[PAGE_SIZE] = 5  # still the owner's pages, written through
        assert int(owner[PAGE_SIZE]) == 5
        del opened
    finally:
        backend.close_all()


def test_a_refusing_kernel_leaves_the_faults_where_they_were(shm_prefix, monkeypatch, caplog):
    def refuse(addr: int, length: int) -> None:
        raise OSError(22, "madvise: Invalid argument")

    monkeypatch.setattr(shm_module, "populate_write", refuse)
    backend = ShmBackend(MemoryAccount("d0", budget=64 * MiB), prefix=shm_prefix)
    try:
        opened = open_tensor(backend.export(backend.allocate((SIZE,), torch.uint8)))
        with caplog.at_level(logging.INFO, logger="hmm.memory.shm"):
            shm_module.prefault(opened, "test pool").join(30)
        assert "test pool: not faulted in ahead" in caplog.text
        assert _mapping_rss_kib(opened) < 64
        opened.fill_(3)  # the pool works as before: its first writes fault instead
        assert int(opened.sum()) == 3 * SIZE
        del opened
    finally:
        backend.close_all()


def test_populate_write_fails_loudly_on_a_range_not_mapped():
    addr = reserve(PAGE_SIZE)
    munmap_raw(addr, PAGE_SIZE)
    with pytest.raises(OSError, match="POPULATE_WRITE"):
        populate_write(addr, PAGE_SIZE)


def test_the_kv_provider_faults_in_the_pool_it_hands_the_engine(shm_prefix):
    spec = KVCacheSpec(num_layers=2, block_size=16, token_shape=(2, 4, 64), dtype=torch.float32)
    num_blocks = 64  # 8 MiB of the 16 MiB pool
    backend = ShmBackend(MemoryAccount("d0", budget=64 * MiB), prefix=shm_prefix)
    try:
        provider = HandleKVProvider(backend.export(backend.allocate((SIZE,), torch.uint8)))
        pool = provider.allocate(spec, num_blocks)
        assert provider.prefaulting is not None
        provider.prefaulting.join(30)
        assert not provider.prefaulting.is_alive()
        assert _mapping_rss_kib(pool) >= spec.bytes_per_block * num_blocks // 1024 * 9 // 10
        assert _mapping_rss_kib(pool) <= SIZE // 1024 // 2 + 64  # only the engine's part of the pool
        del pool, provider
    finally:
        backend.close_all()
