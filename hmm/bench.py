"""HMM benchmark: `python -m hmm.bench --model DIR --json`.

Prints medians over `--repeats` of: zero-copy attach vs disk load vs in-memory
copy of a whole model; remap of all experts of a layer (zero-copy, new slot
order) vs reallocate-and-copy; p2p GB/s over gloo and the same-node fast path
(two Ray device workers); peak bytes per device for DP2 -> DP3, measured while
executing the plan and as computed for the plan and for a naive second full copy; ESFT F_mem with padding vs vpage. Timings on shared
machines are noisy: compare ratios measured in the same run.
"""

from __future__ import annotations

import argparse
import json
import secrets
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from elasticmoe.config import ModelConfig
from elasticmoe.models.registry import model_family
from elasticmoe.models.weights import SafetensorsWeightProvider
from hmm.controller import HMMController
from hmm.device_memory import DeviceMemory
from hmm.layout import DeviceSpec, ModelSizes, TensorKey, layout_for
from hmm.memory import VirtualTensor
from hmm.memory.fragmentation import DEEPSEEK_V2_LITE, fmem_padding, fmem_vpage, load_esft_configs
from hmm.planner import naive_full_copy_plan, plan, scale_target
from hmm.providers import HandleWeightProvider

ESFT_DIR = "/work/shared/data/esft_expert_configs"
GiB = 1 << 30


def median_s(fn: Callable[[], object], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def bench_attach(model_dir: str, dtype: torch.dtype, repeats: int, prefix: str) -> dict[str, float]:
    cfg = ModelConfig.from_pretrained(model_dir)
    specs = model_family(cfg.arch).param_specs(cfg, tuple(range(cfg.num_experts)))
    dm = DeviceMemory(0, 4 * GiB, prefix=prefix)
    try:
        dm.begin(specs, dtype, 0)
        dm.load_from_disk(model_dir, specs, dtype)
        dm.commit()
        handles = dm.export_handles()
        attach = median_s(lambda: [HandleWeightProvider(handles).get(s, dtype) for s in specs], repeats)
        disk = median_s(lambda: [SafetensorsWeightProvider(model_dir).get(s, dtype) for s in specs], repeats)
        tensors = [dm.readable(TensorKey.dense(s.name)) for s in specs if not s.is_stacked]
        tensors += [dm.current.experts[s.name].vt.tensor for s in specs if s.is_stacked]
        copy = median_s(lambda: [t.clone() for t in tensors], repeats)
        remap, realloc = bench_remap(dm, specs[-1].name, repeats)
    finally:
        dm.close()
    return {
        "attach_s": attach,
        "disk_load_s": disk,
        "memory_copy_s": copy,
        "disk_over_attach": disk / attach,
        "remap_layer_s": remap,
        "realloc_copy_layer_s": realloc,
        "realloc_over_remap": realloc / remap,
    }


def bench_remap(dm: DeviceMemory, name: str, repeats: int) -> tuple[float, float]:
    """All experts of one stacked tensor in reversed slot order: new pages-only tensor vs copy."""
    stack = dm.current.experts[name]
    old, n = stack.vt, len(stack.expert_ids)

    def remap() -> None:
        vt = VirtualTensor(dm.pool, n, old.slot_shape, old.dtype, align_slots=True)
        for slot in range(n):
            vt.map_slot(slot, source=old.slot_pages(n - 1 - slot))
        vt.close()

    def realloc() -> None:
        t = dm.shm.allocate(old.tensor.shape, old.dtype)
        t.copy_(old.tensor.flip(0))
        dm.shm.free(t)

    return median_s(remap, repeats), median_s(realloc, repeats)


def bench_p2p(repeats: int, prefix: str, nbytes: int = 64 << 20) -> dict[str, float]:
    import ray

    from elasticmoe.models.weights import ParamSpec
    from hmm.local_ray import init_local_ray
    from hmm.p2p import GroupSpec, HandleCopy, Transfer
    from hmm.worker import DeviceWorkerActor

    init_local_ray(num_cpus=2, log_to_driver=False)
    workers: list[Any] = [
        DeviceWorkerActor.remote(DeviceSpec(i, 0, 2 * nbytes), 4096, prefix) for i in range(2)
    ]
    try:
        addr, port = ray.get([workers[0].node_address.remote(), workers[0].free_port.remote()])
        ray.get([w.join_group.remote(GroupSpec(2, addr, port, 0), r) for r, w in enumerate(workers)])
        spec, key = ParamSpec("buf", (nbytes // 4,), (("buf",),)), TensorKey.dense("buf")
        ray.get([w.begin.remote([spec], torch.float32, 0) for w in workers])
        ray.get(workers[0].commit.remote())

        def gloo() -> None:
            sends, recvs = [Transfer("send", 1, 0, key)], [Transfer("recv", 0, 0, key)]
            ray.get([workers[0].run_transfers.remote(sends), workers[1].run_transfers.remote(recvs)])

        def fast() -> None:
            ((h, slot),) = ray.get(workers[0].source_handles.remote([key]))
            ray.get(workers[1].copy_from_handles.remote([HandleCopy(key, h, slot)]))

        return {
            "p2p_gloo_GBps": nbytes / median_s(gloo, repeats) / 1e9,
            "p2p_fast_GBps": nbytes / median_s(fast, repeats) / 1e9,
        }
    finally:
        ray.get([w.shutdown.remote() for w in workers])
        ray.shutdown()


def bench_peak(model_dir: str, dtype: torch.dtype) -> dict[str, object]:
    cfg = ModelConfig.from_pretrained(model_dir)
    sizes = ModelSizes.from_model(cfg, dtype.itemsize)
    kv = sizes.weight_bytes(cfg.num_experts) // 4
    devices = [DeviceSpec(i, 0, 4 * sizes.weight_bytes(cfg.num_experts)) for i in range(3)]
    current = layout_for(None, sizes, devices, 2, 2, kv_bytes=kv)
    target = scale_target(current, 3, devices[2:], kv_bytes=kv)
    planned, naive = plan(current, target), naive_full_copy_plan(current, target)
    return {
        "dp2_to_dp3_peak_bytes_measured": measure_peak(model_dir, dtype, devices, kv),
        "dp2_to_dp3_peak_bytes_planned": planned.peak_bytes(),
        "dp2_to_dp3_peak_bytes_naive": naive.peak_bytes(),
        "dp2_to_dp3_final_bytes": {d: planned.target.total_bytes(d) for d in planned.target.device_ids},
        "dp2_to_dp3_bytes_moved_planned": planned.bytes_moved,
        "dp2_to_dp3_bytes_moved_naive": naive.bytes_moved,
    }


def measure_peak(model_dir: str, dtype: torch.dtype, devices: list[DeviceSpec], kv: int) -> dict[int, int]:
    """Peak bytes per device actually allocated while executing the DP2 -> DP3 plan
    (in-process workers, same-node fast path), old layout still mapped until commit."""
    hmm = HMMController(use_ray=False, p2p="fast", prefix=f"emoepeak{secrets.token_hex(4)}")
    try:
        hmm.add_devices(devices)
        hmm.load(model_dir, dp=2, dtype=dtype, kv_bytes=kv)
        hmm.reset_peak()
        assert hmm.layout is not None
        hmm.execute(hmm.plan(scale_target(hmm.layout, 3, devices[2:], kv_bytes=kv)))
        peaks = {d: u.peak for d, u in hmm.usage().items()}
        hmm.commit()
        return peaks
    finally:
        hmm.shutdown()


def bench_fmem(page_size: int = 2 << 20) -> dict[str, float]:
    configs = load_esft_configs(ESFT_DIR)
    m = DEEPSEEK_V2_LITE.num_experts
    return {
        "fmem_padding": fmem_padding(configs, m),
        "fmem_vpage": fmem_vpage(configs, m, DEEPSEEK_V2_LITE.expert_bytes, page_size),
    }


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--no-p2p", action="store_true", help="skip the Ray p2p measurement")
    ap.add_argument("--json", action="store_true", help="print one JSON object (the default output)")
    args = ap.parse_args(argv)
    dtype = getattr(torch, args.dtype)
    prefix = f"emoehmmbench{secrets.token_hex(4)}"
    out: dict[str, object] = {"model": args.model, "dtype": args.dtype, "repeats": args.repeats}
    out.update(bench_attach(args.model, dtype, args.repeats, prefix))
    if not args.no_p2p:
        out.update(bench_p2p(args.repeats, prefix))
    out.update(bench_peak(args.model, dtype))
    out.update(bench_fmem())
    print(json.dumps(out, indent=None if args.json else 2))


if __name__ == "__main__":
    main()
