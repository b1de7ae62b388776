"""Per-device accounting and the shm backend's in-process behaviour (budget, peak,
handles, no leaks)."""

from __future__ import annotations

import gc
import os
import pickle

import pytest
import torch

from hmm.memory import MemoryAccount, OutOfDeviceMemory, ShmBackend, TensorHandle, list_segments, open_tensor

KiB = 1024


def test_account_tracks_current_and_peak():
    acct = MemoryAccount("dev0", budget=100)
    acct.reserve(60)
    acct.reserve(30)
    acct.release(60)
    assert (acct.used, acct.peak) == (30, 90)
    acct.reset_peak()
    assert acct.peak == 30
    acct.reserve(20)
    assert acct.usage().free == 50 and acct.peak == 50


def test_account_over_budget_raises_and_changes_nothing():
    acct = MemoryAccount(3, budget=100)
    acct.reserve(80)
    with pytest.raises(OutOfDeviceMemory) as info:
        acct.reserve(21)
    err = info.value
    assert (err.device_id, err.requested, err.used, err.budget) == ("3", 21, 80, 100)
    assert "device 3" in str(err) and "requested 21" in str(err)
    assert (acct.used, acct.peak) == (80, 80)
    with pytest.raises(ValueError):
        acct.release(81)


def test_backend_over_budget_leaves_no_file_and_no_charge(shm_prefix):
    acct = MemoryAccount("d1", budget=64 * KiB)
    backend = ShmBackend(acct, prefix=shm_prefix)
    kept = backend.allocate((8 * KiB,), torch.float32)  # 32 KiB
    assert acct.used == 32 * KiB
    assert backend.can_allocate((8 * KiB,), torch.float32)
    assert not backend.can_allocate((9 * KiB,), torch.float32)
    with pytest.raises(OutOfDeviceMemory) as info:
        backend.allocate((9 * KiB,), torch.float32)  # 36 KiB > 32 KiB free
    assert info.value.requested == 36 * KiB
    assert acct.used == 32 * KiB and acct.peak == 32 * KiB
    files = [n for n in list_segments(shm_prefix) if "-lease-" not in n]  # beside this process's lease
    assert files == backend.names() and len(backend.names()) == 1
    backend.free(kept)
    assert acct.used == 0 and acct.peak == 32 * KiB and list_segments(shm_prefix) == []


def test_backend_peak_and_free_by_handle(shm_prefix):
    acct = MemoryAccount(0, budget=1024 * KiB)
    backend = ShmBackend(acct, prefix=shm_prefix)
    a = backend.allocate((100, 10), torch.bfloat16)  # 2000 bytes -> one 4 KiB page charged
    b = backend.allocate((64, KiB), torch.uint8)
    assert acct.used == 4 * KiB + 64 * KiB
    backend.free(backend.export(a))
    backend.free(b)
    assert acct.used == 0 and acct.peak == 68 * KiB
    acct.reset_peak()
    assert acct.peak == 0


def test_names_are_unique_per_device(shm_prefix):
    b0 = ShmBackend(MemoryAccount(0, 1 << 20), prefix=shm_prefix)
    b1 = ShmBackend(MemoryAccount(1, 1 << 20), prefix=shm_prefix)
    for _ in range(5):
        b0.allocate((16,), torch.float32)
        b1.allocate((16,), torch.float32)
    names = b0.names() + b1.names()
    assert len(set(names)) == 10
    assert all(f"{shm_prefix}-d0-" in n for n in b0.names()) and all("-d1-" in n for n in b1.names())
    b0.close_all()
    b1.close_all()


def test_handle_is_picklable_and_views_roundtrip(shm_prefix):
    backend = ShmBackend(MemoryAccount(0, 1 << 20), prefix=shm_prefix)
    t = backend.allocate((4, 6, 8), torch.float32)
    t.copy_(torch.arange(t.numel(), dtype=torch.float32).view(4, 6, 8))
    for view in (t, t[2], t[:, 1:5, ::2], t.transpose(0, 2)):
        handle = pickle.loads(pickle.dumps(backend.export(view)))
        assert isinstance(handle, TensorHandle) and handle.device_id == "0"
        opened = open_tensor(handle)
        assert opened.stride() == view.stride() and torch.equal(opened, view)
    expert = open_tensor(backend.export(t).select(3))
    expert[0, 0] = -1.0  # same pages: visible through the owner's tensor
    assert t[3, 0, 0] == -1.0
    backend.close_all()
    assert expert[0, 0] == -1.0  # an open mapping outlives the free
    with pytest.raises(KeyError):
        backend.export(t)


def test_zero_size_and_unknown_tensors(shm_prefix):
    backend = ShmBackend(MemoryAccount(0, 1 << 20), prefix=shm_prefix)
    empty = backend.allocate((0, 3), torch.float32)
    assert open_tensor(backend.export(empty)).shape == (0, 3)
    with pytest.raises(KeyError):
        backend.export(torch.zeros(3))
    backend.close_all()
    assert backend.account.used == 0


def test_backend_garbage_collection_unlinks(shm_prefix):
    backend = ShmBackend(MemoryAccount(0, 1 << 20), prefix=shm_prefix)
    backend.allocate((16,), torch.float32)
    path = os.path.join("/dev/shm", backend.names()[0])
    del backend
    gc.collect()
    assert not os.path.exists(path)
