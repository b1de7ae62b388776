"""The elastic server in tests: one configuration factory and one lifetime, shared by every module.

`tiny_config(model_dir, **overrides)` is a `CoordinatorConfig` on the tiny model (float32,
small devices, a shared-memory prefix of its own, no standby pool unless a module asks for it); `running(config)` starts the server
on a free localhost port with a local Ray (`via_serve_proxy`: behind Serve's HTTP proxy, as
KubeRay runs it), and on exit shuts it down and checks that no shared-memory file of it is left. `cluster_of(config)` does the same for a
`ClusterManager` without HTTP. Each module holds one of them as a module fixture.
"""

from __future__ import annotations

import contextlib
import gc
import secrets
from collections.abc import Iterator
from typing import Any

import ray

from coordinator.cluster import ClusterManager
from coordinator.config import CoordinatorConfig
from coordinator.launch import ElasticServer, start_elastic
from elasticmoe.utils.ports import free_port
from hmm.local_ray import init_local_ray
from hmm.memory import list_segments
from hmm.placement import DEVICE_RESOURCE

MODEL = "tiny-qwen3-moe"
RAY = {"num_cpus": 2, "log_to_driver": False}


def tiny_config(model_dir: str, **overrides: Any) -> CoordinatorConfig:
    # NOTE: the standby pool boots dp-1 and dp+1 in the background after every scale: on 2 cores
    # that is a third to a half of a scaling module's CPU time, for instances most tests never use.
    # The modules that test the pool (or the autoscaler's production path) turn it on.
    defaults: dict[str, Any] = {
        "model_dir": model_dir, "num_devices": 2, "dp": 1, "dtype": "float32", "device_memory_bytes": 64 << 20,
        "kv_bytes_per_device": 4 << 20, "served_model_name": MODEL, "shm_prefix": f"emoetest{secrets.token_hex(4)}",
        "standby_pool": False,
    }
    return CoordinatorConfig(**{**defaults, **overrides})


@contextlib.contextmanager
def running(config: CoordinatorConfig, via_serve_proxy: bool = False) -> Iterator[ElasticServer]:
    server = start_elastic(config, port=free_port(), ray_init_kwargs=RAY, via_serve_proxy=via_serve_proxy)
    try:
        yield server
    finally:
        server.shutdown()
        gc.collect()
    assert list_segments(config.shm_prefix) == [], "shared-memory files leaked"


@contextlib.contextmanager
def cluster_of(config: CoordinatorConfig) -> Iterator[ClusterManager]:
    init_local_ray(**RAY, resources={DEVICE_RESOURCE: config.num_devices})
    cluster = ClusterManager(config)
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.shutdown()
        ray.shutdown()
        gc.collect()
    assert list_segments(config.shm_prefix) == [], "shared-memory files leaked"
