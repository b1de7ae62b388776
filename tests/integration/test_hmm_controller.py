"""HMMController over Ray device workers on the tiny Qwen3-MoE checkpoint:
initial load (each tensor read from disk once), DP1 -> DP2 with zero-copy reuse
and minimal expert moves, old handles valid until commit, EP=2 engines on the
committed handle sets; execute + abort (and an injected failure) roll back."""

from __future__ import annotations

import gc
import json
import secrets
from pathlib import Path

import pytest
import ray
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from safetensors import safe_open

from elasticmoe.config import EngineConfig, ModelConfig
from elasticmoe.engine.llm_engine import LLMEngine
from elasticmoe.models.registry import model_family
from elasticmoe.models.weights import SafetensorsWeightProvider
from elasticmoe.parallel.lockstep import run_until_all_done
from elasticmoe.sampling_params import SamplingParams
from elasticmoe.utils.ports import free_port
from hmm.controller import HMMController
from hmm.layout import DeviceSpec
from hmm.local_ray import init_local_ray
from hmm.memory import TensorHandle, list_segments
from hmm.planner import scale_target
from hmm.providers import HandleKVProvider, HandleWeightProvider, open_handle
from hmm.scale_plan import P2PCopy, Reuse

pytestmark = pytest.mark.slow

BUDGET, KV, PAGE = 32 << 20, 256 << 10, 4096
PROMPTS = {0: [[5, 6, 7, 8, 9, 10]], 1: [[11, 12, 13]]}


@pytest.fixture(scope="module")
def prefix():
    init_local_ray(num_cpus=2, log_to_driver=False)
    prefix = f"emoetest{secrets.token_hex(4)}"
    yield prefix
    ray.shutdown()
    gc.collect()
    assert list_segments(prefix) == [], "shared-memory files leaked"


@pytest.fixture
def controller(prefix, tiny_model_dir):
    ctl = HMMController(use_ray=True, page_size=PAGE, prefix=prefix)
    ctl.add_device(DeviceSpec(0, 0, BUDGET))
    ctl.load(tiny_model_dir, dp=1, dtype=torch.float32, kv_bytes=KV)
    yield ctl
    ctl.shutdown()


def _checkpoint_bytes(model_dir: str) -> int:
    total = 0
    for path in Path(model_dir).glob("*.safetensors"):
        with safe_open(str(path), framework="pt") as f:
            total += sum(f.get_tensor(n).nbytes for n in f.keys())
    return total


def _generate(engine: LLMEngine, prompts, group=None) -> list[list[int]]:
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))
    if group is not None:
        outs = run_until_all_done(engine, group)
    else:
        outs = []
        while engine.has_unfinished_requests():
            outs += engine.step()
    return [o.output_token_ids for o in sorted(outs, key=lambda o: o.request_id) if o.finished]


def _check_layout_holds_the_checkpoint(ctl: HMMController, model_dir: str) -> None:
    """Every rank's handles of the committed layout read exactly the checkpoint's tensors."""
    reader = SafetensorsWeightProvider(model_dir)
    cfg = ModelConfig.from_pretrained(model_dir)
    for rank in range(ctl.layout.dp):
        hs = ctl.handle_set(rank)
        for spec in model_family(cfg.arch).param_specs(cfg, ctl.layout.local_experts(ctl.layout.device_ids[rank])):
            assert torch.equal(open_handle(hs[spec.name]), reader.get(spec, torch.float32)), spec.name


def _ep_rank(rank: int, port: int, model_dir: str, handles, placement, queue) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        cfg = EngineConfig(
            model=model_dir, dtype=torch.float32, ep_rank=rank, ep_size=2, num_threads=1, num_kv_blocks=16
        )
        wp, kp = HandleWeightProvider(handles), HandleKVProvider.from_handle_set(handles)
        engine = LLMEngine(cfg, wp, kp, placement, dist.group.WORLD)
        assert all(engine.weights[n].data_ptr() == t.data_ptr() for n, t in wp.opened.items())
        queue.put((rank, _generate(engine, PROMPTS[rank], dist.group.WORLD)))
    except BaseException as e:
        queue.put((rank, f"rank {rank} failed: {e!r}"))
        raise
    finally:
        dist.destroy_process_group()


def test_load_then_dp1_to_dp2(controller, tiny_model_dir):
    ctl = controller
    assert ctl.bytes_read_from_disk == _checkpoint_bytes(tiny_model_dir)  # every tensor once
    old = ctl.handle_set(0)
    ctl.add_device(DeviceSpec(1, 0, BUDGET))
    p = ctl.plan(scale_target(ctl.layout, 2, [DeviceSpec(1, 0, BUDGET)], kv_bytes=KV))
    stats = ctl.execute(p)
    assert stats["bytes_p2p_fast"] + stats["bytes_p2p_gloo"] == p.bytes_p2p and stats["bytes_disk"] == 0
    assert {s.dst_device for s in p.steps if isinstance(s, P2PCopy)} == {1}  # device 0 receives nothing
    assert all(s.device == 0 for s in p.steps if isinstance(s, Reuse))
    assert p.num_experts_moved == 4  # 8 experts: device 0 keeps 4, device 1 gets the other 4
    # Device 0's staged non-expert tensors are the same shm files (zero-copy reuse).
    staged = ray.get(ctl.worker(0).export_handles.remote(True))
    dense = [n for n, h in old.items() if isinstance(h, TensorHandle)]
    assert all(staged[n] == old[n] for n in dense)
    # Old handles unchanged and valid until commit: all 8 experts readable as before.
    assert ctl.handle_set(0) == old
    reader = SafetensorsWeightProvider(tiny_model_dir)
    cfg = ModelConfig.from_pretrained(tiny_model_dir)
    family = model_family(cfg.arch)
    for spec in family.param_specs(cfg, tuple(range(8))):
        assert torch.equal(open_handle(old[spec.name]), reader.get(spec, torch.float32))
    ctl.commit()

    for rank in range(2):
        hs = ctl.handle_set(rank)
        local = ctl.layout.local_experts(ctl.layout.device_ids[rank])
        assert len(local) == 4
        for spec in family.param_specs(cfg, local):
            assert torch.equal(open_handle(hs[spec.name]), reader.get(spec, torch.float32)), spec.name

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    args = [(r, port, tiny_model_dir, ctl.handle_set(r), ctl.layout.placement, queue) for r in range(2)]
    procs = [ctx.Process(target=_ep_rank, args=a) for a in args]
    for proc in procs:
        proc.start()
    results = dict(queue.get(timeout=240) for _ in procs)
    for proc in procs:
        proc.join(timeout=60)
    assert not [r for r in results.values() if isinstance(r, str)], results
    for rank, prompts in PROMPTS.items():
        ref = LLMEngine(EngineConfig(model=tiny_model_dir, dtype=torch.float32, num_kv_blocks=16))
        assert results[rank] == _generate(ref, prompts)


@pytest.mark.parametrize("fail", [None, "copy_from_handles", "begin"])
def test_execute_then_abort_restores_the_old_layout(controller, fail):
    ctl = controller
    old, before = ctl.handle_set(0), ctl.usage()[0].used
    new = DeviceSpec(1, 0, BUDGET)
    ctl.add_device(new)
    p = ctl.plan(scale_target(ctl.layout, 2, [new], kv_bytes=KV))
    if fail is None:
        ctl.execute(p)
        assert ctl.usage()[1].used > 0
        ctl.abort()
    else:
        ray.get(ctl.worker(1).fail_next.remote(fail))
        with pytest.raises(ray.exceptions.RayTaskError, match="injected failure"):
            ctl.execute(p)
    assert ctl.pending is None and ctl.layout is p.current
    assert ctl.handle_set(0) == old
    assert ctl.usage()[0].used == before and ctl.usage()[1].used == 0
    ctl.execute(p)  # the rolled-back state is usable: the same plan now succeeds
    ctl.commit()
    assert json.dumps(sorted(ctl.layout.local_experts(1))) == "[4, 5, 6, 7]"


def test_load_dp2_over_gloo_reads_each_tensor_once(prefix, tiny_model_dir):
    ctl = HMMController(use_ray=True, p2p="gloo", page_size=PAGE, prefix=prefix)
    try:
        for d in range(2):
            ctl.add_device(DeviceSpec(d, 0, BUDGET))
        moved = ctl.load(tiny_model_dir, dp=2, dtype=torch.float32, kv_bytes=KV)
        assert ctl.bytes_read_from_disk == _checkpoint_bytes(tiny_model_dir) == moved["bytes_disk"]  # once each
        assert moved["bytes_p2p_gloo"] > 0 and ctl.group is not None and ctl.group.world_size == 2
        _check_layout_holds_the_checkpoint(ctl, tiny_model_dir)
    finally:
        ctl.shutdown()


@pytest.mark.parametrize("p2p", ["gloo", "auto"])
def test_a_killed_device_worker_is_restored_and_its_files_reaped(prefix, tiny_model_dir, p2p):
    """kill -9 of a device worker's process: a new worker reaps the dead one's /dev/shm files, gets
    its replicated tensors by p2p from the other device and its experts from disk; every tensor
    equals the checkpoint, the other device's are untouched, and the layout scales as before."""
    import os
    import signal

    ctl = HMMController(use_ray=True, p2p=p2p, page_size=PAGE, prefix=prefix)
    try:
        for d in range(2):
            ctl.add_device(DeviceSpec(d, 0, BUDGET))
        ctl.load(tiny_model_dir, dp=2, dtype=torch.float32, kv_bytes=KV)
        kept = ctl.handle_set(0)
        pid = ray.get(ctl.worker(1).check_health.remote())["pid"]
        dead_files = {n for n in list_segments(prefix) if f"-{pid}o" in n}
        assert dead_files  # its tensors, page pool and lease
        os.kill(pid, signal.SIGKILL)
        with pytest.raises(ray.exceptions.RayActorError):
            ray.get(ctl.worker(1).check_health.remote(), timeout=30)
        read_before = ctl.bytes_read_from_disk
        stats = ctl.restore_device(1)
        assert not dead_files & set(list_segments(prefix))  # the dead worker's memory is freed
        assert stats["bytes_p2p_fast"] + stats["bytes_p2p_gloo"] > 0  # replicas from device 0
        assert stats["bytes_disk"] == ctl.bytes_read_from_disk - read_before > 0  # its experts
        _check_layout_holds_the_checkpoint(ctl, tiny_model_dir)
        assert ctl.handle_set(0) == kept
        ctl.add_device(DeviceSpec(2, 0, BUDGET))  # and it scales on: the p2p group includes it
        ctl.execute(ctl.plan(scale_target(ctl.layout, 3, [DeviceSpec(2, 0, BUDGET)], kv_bytes=KV)))
        ctl.commit()
    finally:
        ctl.shutdown()
