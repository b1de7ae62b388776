"""p2p between DeviceWorker actors: gloo send/recv and the same-node fast path copy
the right bytes; adding a third device rebuilds the group and p2p reaches it."""

from __future__ import annotations

import gc
import secrets

import pytest
import ray
import torch

from elasticmoe.models.weights import ParamSpec
from hmm.layout import DeviceSpec, TensorKey
from hmm.local_ray import init_local_ray
from hmm.memory import list_segments
from hmm.p2p import GroupSpec, HandleCopy, Transfer
from hmm.worker import DeviceWorkerActor

pytestmark = pytest.mark.slow

PAGE = 4096
DENSE = ParamSpec("embed", (64, 32), (("model.embed_tokens.weight",),))
STACK = ParamSpec("layers.0.moe.w2", (2, 32, 32), (("a",), ("b",)), (3, 5))
EMBED, ROW5 = TensorKey.dense("embed"), TensorKey.expert_row("layers.0.moe.w2", 0, 5)


@pytest.fixture(scope="module")
def prefix():
    init_local_ray(num_cpus=2, log_to_driver=False)
    prefix = f"emoetest{secrets.token_hex(4)}"
    yield prefix
    ray.shutdown()
    gc.collect()
    assert list_segments(prefix) == [], "shared-memory files leaked"


def _start(n: int, prefix: str) -> list:
    return [DeviceWorkerActor.remote(DeviceSpec(i, 0, 16 << 20), PAGE, prefix) for i in range(n)]


def _join(workers: list, epoch: int) -> None:
    addr, port = ray.get([workers[0].node_address.remote(), workers[0].free_port.remote()])
    spec = GroupSpec(len(workers), addr, port, epoch)
    assert ray.get([w.join_group.remote(spec, r) for r, w in enumerate(workers)]) == [epoch] * len(workers)


def _stage(w, fill: bool) -> None:
    ray.get(w.begin.remote([DENSE, STACK], torch.float32, 0))
    if fill:
        ray.get(w.write.remote(EMBED, torch.arange(64 * 32, dtype=torch.float32).view(64, 32)))
        ray.get(w.write.remote(ROW5, torch.full((32, 32), 5.0)))
        ray.get(w.commit.remote())


def test_gloo_and_fast_path_then_add_device(prefix):
    workers = _start(2, prefix)
    try:
        _join(workers, 0)
        _stage(workers[0], fill=True)
        _stage(workers[1], fill=False)
        sends = [Transfer("send", 1, 0, EMBED), Transfer("send", 1, 1, ROW5)]
        recvs = [Transfer("recv", 0, 0, EMBED), Transfer("recv", 0, 1, ROW5)]
        moved = ray.get([workers[0].run_transfers.remote(sends), workers[1].run_transfers.remote(recvs)])
        assert moved == [64 * 32 * 4 + 32 * 32 * 4] * 2
        ray.get(workers[1].commit.remote())
        for key in (EMBED, ROW5):
            assert torch.equal(ray.get(workers[1].read.remote(key)), ray.get(workers[0].read.remote(key)))

        # Add a device: every worker leaves the old group and joins a 3-rank one (fresh port).
        workers += _start(1, prefix)
        _join(workers, 1)
        _stage(workers[2], fill=False)
        moved = ray.get(
            [
                workers[1].run_transfers.remote([Transfer("send", 2, 7, ROW5)]),
                workers[2].run_transfers.remote([Transfer("recv", 1, 7, ROW5)]),
            ]
        )
        assert moved == [32 * 32 * 4] * 2
        # Fast path: device 2 opens device 0's handles and copies between the mappings.
        sources = ray.get(workers[0].source_handles.remote([EMBED]))
        copies = [HandleCopy(EMBED, h, slot) for h, slot in sources]
        assert ray.get(workers[2].copy_from_handles.remote(copies)) == 64 * 32 * 4
        ray.get(workers[2].commit.remote())
        for key in (EMBED, ROW5):
            assert torch.equal(ray.get(workers[2].read.remote(key)), ray.get(workers[0].read.remote(key)))
        assert not torch.equal(
            ray.get(workers[2].read.remote(TensorKey.expert_row("layers.0.moe.w2", 0, 3))),
            torch.full((32, 32), 5.0),
        )
    finally:
        ray.get([w.shutdown.remote() for w in workers])
        for w in workers:
            ray.kill(w)


def test_a_device_batch_with_a_worker_that_fails_to_start_leaves_the_group_as_it_was(prefix, monkeypatch):
    from hmm import controller, device_workers
    from hmm.worker import DeviceWorker

    class FailsForDevice3(DeviceWorker):
        def __init__(self, spec, *args):
            if spec.device_id == 3:
                raise OSError("no memory for device 3")
            super().__init__(spec, *args)

    ctl = controller.HMMController(use_ray=True, page_size=PAGE, prefix=prefix)
    try:
        ctl.add_devices([DeviceSpec(0, 0, 16 << 20), DeviceSpec(1, 0, 16 << 20)])
        assert ctl.group is not None and (ctl.group.world_size, ctl.group.epoch) == (2, 0)
        monkeypatch.setattr(device_workers, "DeviceWorkerActor", ray.remote(num_cpus=0)(FailsForDevice3))
        with pytest.raises(ray.exceptions.RayActorError, match="device 3"):
            ctl.add_devices([DeviceSpec(2, 0, 16 << 20), DeviceSpec(3, 0, 16 << 20)])
        assert sorted(ctl.devices) == sorted(ctl.workers) == [0, 1]  # device 2's worker stopped too
        assert (ctl.group.world_size, ctl.group.epoch) == (2, 1)  # the two formed a group again
        ctl.add_devices([DeviceSpec(2, 0, 16 << 20)])  # and the next device joins them
        assert (ctl.group.world_size, ctl.group.epoch) == (3, 2)
    finally:
        ctl.shutdown()
