"""A local Ray session with an HMM controller over 2 logical devices, shared by integration tests."""

from __future__ import annotations

import contextlib
import gc
import secrets
from collections.abc import Iterator

import ray
import torch

from hmm.controller import HMMController
from hmm.layout import DeviceSpec
from hmm.local_ray import init_local_ray
from hmm.memory import list_segments


@contextlib.contextmanager
def ray_hmm(model_dir: str, *, dp: int, budget: int, kv_bytes: int, page: int = 4096) -> Iterator[HMMController]:
    """Ray up, HMM loaded at `dp` (float32); on exit everything shut down and no shm file left."""
    init_local_ray(num_cpus=2, log_to_driver=False)
    prefix = f"emoetest{secrets.token_hex(4)}"
    ctl = HMMController(use_ray=True, page_size=page, prefix=prefix)
    try:
        ctl.add_devices([DeviceSpec(d, 0, budget) for d in range(2)])
        ctl.load(model_dir, dp=dp, dtype=torch.float32, kv_bytes=kv_bytes)
        yield ctl
    finally:
        ctl.shutdown()
        ray.shutdown()
        gc.collect()
    assert list_segments(prefix) == [], "shared-memory files leaked"
