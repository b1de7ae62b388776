"""In-process HMM (no Ray) on the tiny Qwen3-MoE checkpoint under each
`TransitionOptions` set: DP2 -> DP3, DP3 -> DP2 and a fresh-device target execute
and commit to the checkpoint's exact tensors on every device; the measured peak
per device is the plan's `peak_bytes` (with sizes as the allocators charge them);
abort restores the accounting exactly; `unload` then `load` works and leaks no
/dev/shm file."""

from __future__ import annotations

import pytest
import torch

from elasticmoe.config import ModelConfig
from elasticmoe.models.registry import model_family
from elasticmoe.models.weights import SafetensorsWeightProvider
from hmm.controller import HMMController
from hmm.layout import KV_POOL, DeviceSpec, Layout, ModelSizes
from hmm.memory import list_segments
from hmm.memory.segments import round_up
from hmm.planner import TargetConfig, plan, scale_target
from hmm.providers import open_handle
from hmm.scale_plan import Alloc, DiskLoad, Free, ScalePlan
from hmm.transition_options import TransitionOptions

PAGE, BUDGET, KV = 4096, 32 << 20, 256 << 10

OPTIONS = {
    "default": TransitionOptions(),
    "no_paged_remap": TransitionOptions(paged_remap=False),
    "no_paged_remap_no_p2p": TransitionOptions(paged_remap=False, p2p=False),
    "nothing": TransitionOptions(zero_copy=False, paged_remap=False, p2p=False),
    "no_zero_copy": TransitionOptions(zero_copy=False),
}


@pytest.fixture
def make_ctl(shm_prefix, tiny_model_dir):
    made: list[HMMController] = []

    def make(num_devices: int, dp: int) -> HMMController:
        ctl = HMMController(use_ray=False, page_size=PAGE, prefix=shm_prefix)
        made.append(ctl)
        for d in range(num_devices):
            ctl.add_device(DeviceSpec(d, 0, BUDGET))
        ctl.load(tiny_model_dir, dp=dp, dtype=torch.float32, kv_bytes=KV)
        return ctl

    yield make
    for ctl in made:
        ctl.shutdown()


def _charged(layout: Layout) -> Layout:
    """`layout` with each tensor's size as charged: shm tensors round up to the OS page,
    expert rows (own pages, `align_slots`) to the pool page."""
    s = layout.sizes
    sizes = ModelSizes(
        s.num_experts,
        tuple((n, round_up(b)) for n, b in s.dense),
        tuple((n, layer, round_up(b, PAGE)) for n, layer, b in s.expert_stacks),
    )
    return Layout(sizes, layout.devices, layout.placement, tuple(round_up(k) for k in layout.kv_bytes))


def _charged_plan(p: ScalePlan) -> ScalePlan:
    assert p.current is not None
    target = TargetConfig(p.target.devices, p.target.dp, p.target.ep, p.target.placement, KV)
    q = plan(_charged(p.current), target, p.options)

    def shape(x: ScalePlan) -> set[tuple[str, int, object]]:
        return {
            (type(s).__name__, getattr(s, "dst_device", getattr(s, "device", -1)), s.key) for s in x.steps
        }

    assert shape(q) == shape(p)  # the same steps, only sizes differ
    return q


def _check_checkpoint(ctl: HMMController, model_dir: str, pending: bool) -> None:
    """Every tensor of every rank (committed or pending layout) equals the checkpoint."""
    cfg = ModelConfig.from_pretrained(model_dir)
    reader = SafetensorsWeightProvider(model_dir)
    layout = ctl.layout_of(pending)
    for rank, d in enumerate(layout.device_ids):
        handles = ctl.handle_set(rank, pending)
        for spec in model_family(cfg.arch).param_specs(cfg, layout.local_experts(d)):
            assert torch.equal(open_handle(handles[spec.name]), reader.get(spec, torch.float32)), (
                d,
                spec.name,
            )
        assert open_handle(handles[KV_POOL]).numel() == KV


def _run(ctl: HMMController, p: ScalePlan, model_dir: str) -> None:
    """Execute, check, abort, execute again, check, commit, check."""
    q = _charged_plan(p)
    ids = p.device_ids()
    before = ctl.usage()
    old = {r: ctl.handle_set(r) for r in range(p.current.dp)}
    assert {d: before[d].used for d in ids} == {d: q.current.total_bytes(d) for d in ids}
    for attempt in range(2):
        ctl.reset_peak()
        stats = ctl.execute(p)
        assert stats["bytes_local_copy"] == p.bytes_local_copy
        assert stats["bytes_p2p_fast"] == p.bytes_p2p and stats["bytes_p2p_gloo"] == 0
        assert stats["bytes_disk"] == p.bytes_disk
        usage = ctl.usage()
        assert {d: usage[d].peak for d in ids} == q.peak_bytes()
        _check_checkpoint(ctl, model_dir, pending=True)
        _check_checkpoint(ctl, model_dir, pending=False)  # old mappings valid until commit
        for d in set(p.current.device_ids) & set(p.target.device_ids):
            pending = ctl.handle_set(p.target.rank_of(d), pending=True)
            same_kv = pending[KV_POOL] == old[p.current.rank_of(d)][KV_POOL]
            assert same_kv == p.options.zero_copy
        if attempt == 0:
            ctl.abort()
            after = ctl.usage()
            assert {d: after[d].used for d in ids} == {d: before[d].used for d in ids}
            assert {r: ctl.handle_set(r) for r in old} == old
    ctl.commit()
    usage = ctl.usage()
    assert {d: usage[d].used for d in ids} == {d: q.target.total_bytes(d) for d in ids}
    _check_checkpoint(ctl, model_dir, pending=False)


@pytest.mark.parametrize("name", list(OPTIONS))
def test_dp2_to_dp3(make_ctl, tiny_model_dir, name):
    ctl = make_ctl(3, dp=2)
    p = ctl.plan(scale_target(ctl.layout, 3, [ctl.devices[2]], kv_bytes=KV), OPTIONS[name])
    assert bool(p.bytes_local_copy) == (name in ("no_paged_remap", "no_paged_remap_no_p2p", "no_zero_copy"))
    _run(ctl, p, tiny_model_dir)


@pytest.mark.parametrize("name", list(OPTIONS))
def test_dp3_to_dp2(make_ctl, tiny_model_dir, name):
    ctl = make_ctl(3, dp=3)
    p = ctl.plan(scale_target(ctl.layout, 2), OPTIONS[name])
    _run(ctl, p, tiny_model_dir)


def test_fresh_devices_without_p2p_load_from_disk(make_ctl, tiny_model_dir):
    ctl = make_ctl(4, dp=2)
    target = TargetConfig((ctl.devices[2], ctl.devices[3]), 2, 2, kv_bytes=KV)
    p = ctl.plan(target, TransitionOptions(p2p=False))
    assert {type(s) for s in p.steps} == {Alloc, DiskLoad, Free}
    _run(ctl, p, tiny_model_dir)
    assert ctl.usage()[0].used == ctl.usage()[1].used == 0


def test_unload_then_load_again(make_ctl, shm_prefix, tiny_model_dir):
    ctl = make_ctl(2, dp=2)
    read = ctl.bytes_read_from_disk
    ctl.unload()
    assert ctl.layout is None and all(u.used == 0 for u in ctl.usage().values())
    # Only the page pools stay (one per device), empty and ready for the next load (and the lease).
    files = [n for n in list_segments(shm_prefix) if "-lease-" not in n]
    assert len(files) == 2 and all("-pool-" in n for n in files)
    ctl.load(tiny_model_dir, dp=2, dtype=torch.float32, kv_bytes=KV)
    assert ctl.bytes_read_from_disk == 2 * read
    _check_checkpoint(ctl, tiny_model_dir, pending=False)
    # The reloaded model scales as usual.
    ctl.add_device(DeviceSpec(2, 0, BUDGET))
    ctl.execute(ctl.plan(scale_target(ctl.layout, 3, [ctl.devices[2]], kv_bytes=KV)))
    ctl.commit()
    _check_checkpoint(ctl, tiny_model_dir, pending=False)
