"""DeviceMemory without Ray: subset disk loads read exactly the subset, an engine
over its handles matches the default engine (weights used in place), staged
expert tensors share the kept experts' pages, abort/commit keep the accounting,
and the in-process controller rolls back a failed execute."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from elasticmoe.config import EngineConfig, ModelConfig
from elasticmoe.engine.llm_engine import LLMEngine
from elasticmoe.models.registry import model_family
from elasticmoe.models.weights import SafetensorsWeightProvider
from elasticmoe.sampling_params import SamplingParams
from hmm.controller import HMMController
from hmm.device_memory import DeviceMemory
from hmm.layout import DeviceSpec, TensorKey
from hmm.planner import scale_target
from hmm.providers import HandleKVProvider, HandleWeightProvider, open_handle
from hmm.worker import InjectedFailure

PAGE, BUDGET, KV = 4096, 32 << 20, 256 << 10


def _specs(model_dir: str, experts: tuple[int, ...]):
    cfg = ModelConfig.from_pretrained(model_dir)
    return model_family(cfg.arch).param_specs(cfg, experts)


def _nbytes(model_dir: str, names: set[str]) -> int:
    total = 0
    for path in Path(model_dir).glob("*.safetensors"):
        with safe_open(str(path), framework="pt") as f:
            total += sum(f.get_tensor(n).nbytes for n in f.keys() if n in names)
    return total


def _generate(engine: LLMEngine) -> list[list[int]]:
    engine.add_request(
        "a", [5, 6, 7, 8, 9, 10], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    )
    outs = []
    while engine.has_unfinished_requests():
        outs += engine.step()
    return [o.output_token_ids for o in outs if o.finished]


def test_subset_load_reads_exactly_the_subset(tiny_model_dir, shm_prefix):
    dm = DeviceMemory(0, BUDGET, PAGE, shm_prefix)
    try:
        specs = _specs(tiny_model_dir, (2, 5))
        assert dm.begin(specs, torch.float32, KV)
        subset = [s for s in specs if s.name in ("embed", "layers.1.moe.w13")]
        read = dm.load_from_disk(tiny_model_dir, subset, torch.float32)
        names = {n for s in subset for group in s.sources for n in group}
        assert read == _nbytes(tiny_model_dir, names)  # 2 experts of one layer + the embedding
        ref = SafetensorsWeightProvider(tiny_model_dir)
        w13 = dm.writable(TensorKey.expert_row("layers.1.moe.w13", 1, 5))
        assert torch.equal(w13, ref.get(subset[1], torch.float32)[1])
        dm.commit()
    finally:
        dm.close()


def test_engine_on_handles_matches_default_engine(tiny_model_dir, shm_prefix):
    dm = DeviceMemory(0, BUDGET, PAGE, shm_prefix)
    try:
        specs = _specs(tiny_model_dir, tuple(range(8)))
        dm.begin(specs, torch.float32, KV)
        dm.load_from_disk(tiny_model_dir, specs, torch.float32)
        dm.commit()
        handles = dm.export_handles()
        wp, kp = HandleWeightProvider(handles), HandleKVProvider.from_handle_set(handles)
        cfg = EngineConfig(model=tiny_model_dir, dtype=torch.float32, num_kv_blocks=16)
        engine = LLMEngine(cfg, wp, kp)
        assert _generate(engine) == _generate(LLMEngine(cfg))
        assert all(engine.weights[n].data_ptr() == t.data_ptr() for n, t in wp.opened.items())
        assert engine.kv_pool.data_ptr() == kp.pool.data_ptr()
        # Same pages: a write in device memory shows in the engine's (separately mapped) weights.
        dm.writable(TensorKey.expert_row("layers.0.moe.w2", 0, 3)).fill_(7.0)
        dm.writable(TensorKey.dense("norm")).fill_(3.0)
        assert (engine.weights["layers.0.moe.w2"][3] == 7.0).all() and (engine.weights["norm"] == 3.0).all()
        del engine
    finally:
        dm.close()


def test_staged_experts_share_pages_then_abort_or_commit(tiny_model_dir, shm_prefix):
    dm = DeviceMemory(0, BUDGET, PAGE, shm_prefix)
    try:
        dm.begin(_specs(tiny_model_dir, (0, 1, 2, 3)), torch.float32, KV)
        dm.load_from_disk(tiny_model_dir, _specs(tiny_model_dir, (0, 1, 2, 3)), torch.float32)
        dm.commit()
        old, used = dm.export_handles(), dm.usage().used
        old_vt = dm.current.experts["layers.0.moe.w13"].vt
        for attempt in range(2):  # abort, then the same transition again and commit
            keys = dm.begin(_specs(tiny_model_dir, (3, 1, 6)), torch.float32, KV)
            assert {k.expert for k in keys} == {6} and len(keys) == 4  # 2 layers x (w13, w2)
            new_vt = dm.staged.experts["layers.0.moe.w13"].vt
            assert new_vt.slot_pages(0).page_ids == old_vt.slot_pages(3).page_ids  # expert 3: slot 3 -> 0
            assert torch.equal(new_vt.tensor[1], old_vt.tensor[1])
            expert = 2 * (64 * 64 + 64 * 32) * 4  # 2 layers x (w13 [64, 64] + w2 [64, 32]), page multiples
            assert dm.usage().used == used + expert  # only expert 6's pages are new
            assert dm.export_handles() == old
            if attempt == 0:
                dm.abort()
                assert dm.usage().used == used and dm.export_handles() == old
        freed = dm.commit()
        assert freed == 2 * expert  # experts 0 and 2
        assert open_handle(dm.export_handles()["layers.0.moe.w13"]).shape[0] == 3
    finally:
        dm.close()


def test_local_controller_rolls_back_a_failed_execute(tiny_model_dir, shm_prefix):
    ctl = HMMController(use_ray=False, page_size=PAGE, prefix=shm_prefix)
    try:
        ctl.add_device(DeviceSpec(0, 0, BUDGET))
        ctl.load(tiny_model_dir, dp=1, dtype=torch.float32, kv_bytes=KV)
        old, before = ctl.handle_set(0), ctl.usage()[0].used
        ctl.add_device(DeviceSpec(1, 0, BUDGET))
        p = ctl.plan(scale_target(ctl.layout, 2, [DeviceSpec(1, 0, BUDGET)], kv_bytes=KV))
        ctl.worker(1).fail_next("copy_from_handles")
        with pytest.raises(InjectedFailure):
            ctl.execute(p)
        assert ctl.handle_set(0) == old and ctl.usage()[0].used == before and ctl.usage()[1].used == 0
        ctl.execute(p)
        assert ctl.commit() > 0 and ctl.usage()[0].used < before
    finally:
        ctl.shutdown()
