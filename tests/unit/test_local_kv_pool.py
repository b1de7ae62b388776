"""The engine's own KV pool (`LocalKVProvider`): zeroed, writable, and paid for only as used."""

from __future__ import annotations

import gc

import torch

from elasticmoe.engine.kv_cache import KVCacheSpec, LocalKVProvider


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


def test_the_pool_is_zeroed_writable_and_costs_memory_only_where_touched():
    spec = KVCacheSpec(num_layers=4, block_size=16, token_shape=(2, 2, 64), dtype=torch.bfloat16)
    before = _rss_bytes()
    pool = LocalKVProvider().allocate(spec, 4096)  # 128 MiB
    assert pool.shape == spec.pool_shape(4096) and pool.dtype == torch.bfloat16
    assert pool.nbytes == 128 << 20
    assert _rss_bytes() - before < 16 << 20  # not written at allocation
    pool[1, 7].fill_(2.0)
    assert float(pool[1, 7].float().sum()) == 2.0 * pool[1, 7].numel()
    assert float(pool[1, 6].float().abs().sum()) == 0.0 and float(pool[3, 4095].float().abs().sum()) == 0.0
    view = pool[1]
    del pool
    gc.collect()
    assert float(view[7].float().sum()) > 0  # a view keeps the mapping alive
