"""HMM pending handle sets (no Ray): between `execute` and `commit` both the committed and
the pending target's handle sets are valid; on the kept device they share the KV pool and
the reused dense tensors; after `commit` the pending sets are the committed ones; after
`abort` there is nothing pending and the committed layout is untouched."""

from __future__ import annotations

import gc
import secrets

import pytest
import torch

from hmm.controller import HMMController
from hmm.layout import DeviceSpec
from hmm.memory import TensorHandle, list_segments
from hmm.planner import scale_target

PAGE, BUDGET, KV = 4096, 32 << 20, 256 << 10


@pytest.fixture
def ctl(tiny_model_dir):
    prefix = f"emoetest{secrets.token_hex(4)}"
    ctl = HMMController(use_ray=False, page_size=PAGE, prefix=prefix)
    try:
        ctl.add_device(DeviceSpec(0, 0, BUDGET))
        ctl.load(tiny_model_dir, dp=1, dtype=torch.float32, kv_bytes=KV)
        ctl.add_device(DeviceSpec(1, 0, BUDGET))
        yield ctl
    finally:
        ctl.shutdown()
        gc.collect()
    assert list_segments(prefix) == [], "shared-memory files leaked"


def _scale_up(ctl: HMMController) -> None:
    assert ctl.layout is not None
    ctl.execute(ctl.plan(scale_target(ctl.layout, 2, [DeviceSpec(1, 0, BUDGET)], kv_bytes=KV)))


def test_pending_sets_coexist_with_the_committed_ones_until_commit(ctl):
    with pytest.raises(RuntimeError, match="no plan is pending"):
        ctl.handle_set(0, pending=True)
    old = ctl.handle_set(0)
    _scale_up(ctl)
    assert ctl.handle_set(0) == old  # the serving instance's handles are unchanged
    assert ctl.layout_placement().num_ranks == 1 and ctl.pending_placement().num_ranks == 2
    assert ctl.layout_of().device_ids == (0,) and ctl.layout_of(pending=True).device_ids == (0, 1)
    new = [ctl.handle_set(r, pending=True) for r in range(2)]

    # Kept device 0: same KV pool and the same pages for every reused dense tensor.
    assert new[0]["kv_pool"] == old["kv_pool"]
    dense = [k for k, h in old.items() if isinstance(h, TensorHandle) and k != "kv_pool"]
    assert dense and all(new[0][k] == old[k] for k in dense)
    assert new[1]["kv_pool"].name != old["kv_pool"].name  # device 1 got its own pool
    assert set(new[0]) == set(new[1]) == set(old)

    ctl.commit()
    assert [ctl.handle_set(r) for r in range(2)] == new
    with pytest.raises(RuntimeError, match="no plan is pending"):
        ctl.pending_placement()


def test_abort_drops_the_pending_sets(ctl):
    old = ctl.handle_set(0)
    _scale_up(ctl)
    ctl.abort()
    with pytest.raises(RuntimeError, match="no plan is pending"):
        ctl.handle_set(1, pending=True)
    assert ctl.handle_set(0) == old and ctl.layout_placement().num_ranks == 1


def test_devices_added_together_are_checked_before_any_starts(ctl):
    with pytest.raises(ValueError, match=r"\[1, 3\]"):
        ctl.add_devices([DeviceSpec(2, 0, BUDGET), DeviceSpec(1, 0, BUDGET), DeviceSpec(3, 0, BUDGET),
                         DeviceSpec(3, 0, BUDGET)])
    assert sorted(ctl.devices) == [0, 1]  # device 2 was not started either
    ctl.add_devices([DeviceSpec(2, 0, BUDGET), DeviceSpec(3, 0, BUDGET)])
    assert sorted(ctl.devices) == sorted(ctl.workers) == [0, 1, 2, 3]


def test_a_batch_whose_worker_fails_to_start_leaves_nothing_of_itself(ctl, monkeypatch):
    from hmm import device_workers

    real = device_workers.DeviceWorker

    def worker(spec, *args):
        if spec.device_id == 3:
            raise OSError("no memory for device 3")
        return real(spec, *args)

    monkeypatch.setattr(device_workers, "DeviceWorker", worker)
    with pytest.raises(OSError, match="device 3"):
        ctl.add_devices([DeviceSpec(2, 0, BUDGET), DeviceSpec(3, 0, BUDGET)])
    assert sorted(ctl.devices) == sorted(ctl.workers) == [0, 1]  # device 2's worker stopped, its files freed
    _scale_up(ctl)  # the registered devices work on
    ctl.commit()
