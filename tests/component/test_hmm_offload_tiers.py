"""FineMoE's tiers in the HMM, without Ray (tiny Qwen3-MoE, fp32, the in-process controller).

Each device has 900,000 B: at dp 2 a device holds its 4 experts resident (dense 366,080 B + 4 x
49,152 B + a 256 KiB KV pool), at dp 1 it cannot hold all 8 (1,021,440 B). With offloading each
device has an expert cache of half its dp-2 experts (4 rows of one layer's expert, 98,304 B) and its
expert rows are the host tier: the scale to dp 1 is planned and executed within the budget (the
accounting of every allocation enforces it), an engine on the new handles computes in the
device's cache and gives the resident engine's tokens, and a failed scale changes nothing.
With the disk tier no expert is held in memory at all: the engines read them from the checkpoint,
and a scale moves none."""

from __future__ import annotations

import gc

import pytest
import torch

from elasticmoe.config import EngineConfig, ModelConfig
from elasticmoe.engine.llm_engine import LLMEngine
from elasticmoe.sampling_params import SamplingParams
from hmm.controller import HMMController
from hmm.layout import DeviceSpec, ModelSizes, layout_for
from hmm.planner import scale_target
from hmm.scale_plan import DiskLoad, LocalCopy, P2PCopy
from hmm.worker import InjectedFailure
from imm.zero_copy import ZeroCopyLoader

PAGE, BUDGET, KV = 4096, 900_000, 256 << 10
PROMPTS = ([5, 6, 7, 8, 9, 10], [11, 3, 200, 17], [42] * 9)


def _generate(engine: LLMEngine) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(str(i), list(prompt), params)
    outs = []
    while engine.has_unfinished_requests():
        outs += engine.step()
    return [o.output_token_ids for o in sorted((o for o in outs if o.finished), key=lambda o: int(o.request_id))]


def _engine_on(ctl: HMMController, model_dir: str, rank: int, pending: bool, tier: str = "host") -> LLMEngine:
    loader = ZeroCopyLoader(ctl.handle_set(rank, pending=pending))
    config = EngineConfig(model=model_dir, dtype=torch.float32, num_kv_blocks=16, expert_cache_fraction=0.5,
                          offload_policy="lru", ep_size=1, expert_tier=tier)
    assert loader.expert_cache is not None
    return LLMEngine(config, loader.weights, loader.kv, ctl.layout_of(pending).placement, None, loader.expert_cache)


def test_a_scale_down_past_the_resident_limit_offloads_and_serves_exact_tokens(tiny_model_dir, shm_prefix):
    model = ModelConfig.from_pretrained(tiny_model_dir)
    sizes = ModelSizes.from_model(model, 4)
    cache = sizes.cache_pool_bytes(4, fraction=0.5)
    assert cache == 4 * sizes.cache_row_bytes
    devices = [DeviceSpec(0, 0, BUDGET), DeviceSpec(1, 0, BUDGET)]
    with pytest.raises(ValueError, match="exceed its budget"):  # resident, dp 1 does not fit
        layout_for(None, sizes, devices, 1, 1, kv_bytes=KV)
    reference = _generate(LLMEngine(EngineConfig(model=tiny_model_dir, dtype=torch.float32, num_kv_blocks=16)))

    ctl = HMMController(use_ray=False, page_size=PAGE, prefix=shm_prefix)
    try:
        for d in devices:
            ctl.add_device(d)
        ctl.load(tiny_model_dir, dp=2, dtype=torch.float32, kv_bytes=KV, cache_bytes=cache)
        host = {d: u.used for d, u in ctl.host_usage().items()}
        assert host[0] == host[1] >= 4 * sizes.expert_bytes  # each device's experts, once
        used = {d: u.used for d, u in ctl.usage().items()}
        assert all(used[d] < sizes.dense_bytes + KV + 2 * cache for d in used)

        p = ctl.plan(scale_target(ctl.layout, 1, kv_bytes=KV))
        ctl.worker(0).fail_next("begin")  # a failed scale leaves both tiers as they were
        with pytest.raises(InjectedFailure):
            ctl.execute(p)
        assert {d: u.used for d, u in ctl.usage().items()} == used
        assert {d: u.used for d, u in ctl.host_usage().items()} == host

        ctl.execute(p)
        assert ctl.usage()[0].used <= sizes.dense_bytes + KV + 2 * cache + 64 * PAGE  # two caches, no experts
        engine = _engine_on(ctl, tiny_model_dir, 0, pending=True)
        assert engine.offload is not None and engine.offload.cache.capacity == 4  # of 16 (layer, expert)
        assert _generate(engine) == reference
        assert engine.offload.stats()["on_demand_loads"] > 0
        del engine
        gc.collect()
        ctl.commit()
        assert ctl.usage()[0].peak <= BUDGET and ctl.usage()[1].used == 0
        assert ctl.host_usage()[0].used >= 8 * sizes.expert_bytes and ctl.host_usage()[1].used == 0

        ctl.execute(ctl.plan(scale_target(ctl.layout, 2, [devices[1]], kv_bytes=KV)))  # back, by p2p
        ctl.commit()
        caches = [ZeroCopyLoader(ctl.handle_set(r)).expert_cache for r in range(2)]
        assert [c.numel() if c is not None else 0 for c in caches] == [cache, cache]
        assert ctl.host_usage()[1].used == host[1]
        del caches
    finally:
        gc.collect()
        ctl.shutdown()


def test_the_disk_tier_holds_no_expert_and_a_scale_moves_none(tiny_model_dir, shm_prefix):
    model = ModelConfig.from_pretrained(tiny_model_dir)
    sizes = ModelSizes.from_model(model, 4)
    cache = sizes.cache_pool_bytes(4, fraction=0.5)
    devices = [DeviceSpec(0, 0, BUDGET), DeviceSpec(1, 0, BUDGET)]
    reference = _generate(LLMEngine(EngineConfig(model=tiny_model_dir, dtype=torch.float32, num_kv_blocks=16)))

    ctl = HMMController(use_ray=False, page_size=PAGE, prefix=shm_prefix)
    try:
        for d in devices:
            ctl.add_device(d)
        ctl.load(tiny_model_dir, dp=2, dtype=torch.float32, kv_bytes=KV, cache_bytes=cache, host_experts=False)
        assert not ctl.layout.host_experts and ctl.layout.host_bytes(0) == 0
        assert [u.used for u in ctl.host_usage().values()] == [0, 0]  # no expert row anywhere in memory
        assert all(u.used < sizes.dense_bytes + KV + cache + 64 * PAGE for u in ctl.usage().values())

        p = ctl.plan(scale_target(ctl.layout, 1, kv_bytes=KV))
        assert _moves(p) == []  # device 0 keeps its dense weights; no expert is held to move
        ctl.execute(p)
        engine = _engine_on(ctl, tiny_model_dir, 0, pending=True, tier="disk")
        assert engine.offload is not None and engine.offload.cache.source.tier == "disk"
        assert _generate(engine) == reference
        stats = engine.offload.stats()
        assert stats["on_demand_loads"] > 0 and stats["bytes_loaded_disk"] > 0
        del engine
        gc.collect()
        ctl.commit()
        assert [u.used for u in ctl.host_usage().values()] == [0, 0]

        p = ctl.plan(scale_target(ctl.layout, 2, [devices[1]], kv_bytes=KV))
        assert _moves(p) and all(key.kind == "dense" for key in _moves(p))  # the new device's dense weights
        ctl.execute(p)
        ctl.commit()
        assert not ctl.layout.host_experts and [u.used for u in ctl.host_usage().values()] == [0, 0]
        caches = [ZeroCopyLoader(ctl.handle_set(r)).expert_cache for r in range(2)]
        assert [c.numel() if c is not None else 0 for c in caches] == [cache, cache]
        del caches
    finally:
        gc.collect()
        ctl.shutdown()


def _moves(plan) -> list:
    """The tensors a plan copies or reads."""
    return [s.key for s in plan.steps if isinstance(s, P2PCopy | DiskLoad | LocalCopy)]
