"""`Scaler` on a real cluster (tiny Qwen3-MoE, 2 logical devices, float32, no HTTP): a failure
injected before the switchover rolls back (HMM layout and memory exactly as before, the new
instance retired, the old one serving a running stream to the end with unchanged tokens);
then a real DP1 -> DP2 scale hands the running stream over with unchanged tokens."""

from __future__ import annotations

import gc
import secrets
import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import ray

from coordinator.cluster import ClusterManager
from coordinator.config import CoordinatorConfig
from coordinator.scale_events import ScaleState
from coordinator.scaler import Scaler
from elasticmoe.outputs import RequestOutput
from elasticmoe.sampling_params import SamplingParams
from hmm.memory import list_segments
from imm.handover import HandedOverOutput, HandoverRoutes, spliced_stream
from imm.instance import Instance
from imm.lifecycle import InstanceState

pytestmark = pytest.mark.slow

PROMPT = [5, 6, 7, 8, 9, 10]
PARAMS = SamplingParams(temperature=0.0, max_tokens=1500, ignore_eos=True)


@pytest.fixture(scope="module")
def cluster(tiny_model_dir) -> Iterator[ClusterManager]:
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    prefix = f"emoetest{secrets.token_hex(4)}"
    config = CoordinatorConfig(
        model_dir=tiny_model_dir,
        num_devices=2,
        dp=1,
        dtype="float32",
        device_memory_bytes=64 << 20,
        kv_bytes_per_device=4 << 20,
        shm_prefix=prefix,
    )
    cl = ClusterManager(config)
    try:
        cl.start()
        yield cl
    finally:
        cl.shutdown()
        ray.shutdown()
        gc.collect()
    assert list_segments(prefix) == [], "shared-memory files leaked"


def _run_stream(
    cluster: ClusterManager, routes: HandoverRoutes, rid: str, started: threading.Event
) -> list[Any]:
    assert cluster.active is not None
    items: list[Any] = []
    for item in spliced_stream(cluster.active.ranks[0].generate.remote(rid, PROMPT, PARAMS), routes):
        items.append(item)
        if len(items) == 3:
            started.set()
    return items


def _during_scale(cluster: ClusterManager, rid: str, scale: Callable[[Scaler], Any]) -> tuple[Any, list[Any]]:
    """Run `scale(scaler)` while request `rid` streams; (its result, the stream's items)."""
    routes = HandoverRoutes()
    scaler = Scaler(cluster, routes)
    started, result = threading.Event(), {}
    t = threading.Thread(target=lambda: result.update(items=_run_stream(cluster, routes, rid, started)))
    t.start()
    assert started.wait(60)
    out = scale(scaler)
    t.join(120)
    return out, result["items"]


def _tokens(items: list[Any]) -> list[int]:
    outs = [i for i in items if isinstance(i, RequestOutput)]
    assert outs[-1].finished and [t for o in outs for t in o.new_token_ids] == outs[-1].output_token_ids
    return outs[-1].output_token_ids


@pytest.fixture(scope="module")
def baseline(cluster) -> list[int]:
    started = threading.Event()
    return _tokens(_run_stream(cluster, HandoverRoutes(), "baseline", started))


def test_failure_before_switchover_rolls_back(cluster, baseline, monkeypatch):
    hmm, old = cluster.hmm, cluster.active
    used_before = {d: u.used for d, u in hmm.usage().items()}
    created: list[Instance] = []
    original = Instance.create_standby

    def create_standby(*args: Any, **kwargs: Any) -> Instance:
        created.append(original(*args, **kwargs))
        return created[-1]

    def failing_warm_up(self: Instance) -> list[float]:
        raise RuntimeError("injected warm-up failure")

    monkeypatch.setattr(Instance, "create_standby", staticmethod(create_standby))
    monkeypatch.setattr(Instance, "warm_up", failing_warm_up)
    event, items = _during_scale(cluster, "during-failed-scale", lambda s: s.scale(2))

    assert event.state is ScaleState.ROLLED_BACK and "injected warm-up failure" in event.error
    assert event.downtime_s is None  # the gate never closed
    assert not any(isinstance(i, HandedOverOutput) for i in items)
    assert _tokens(items) == baseline  # the old instance kept serving it
    assert cluster.active is old and old.is_serving and cluster.router.is_open
    assert hmm.pending is None and hmm.layout.dp == 1
    assert {d: u.used for d, u in hmm.usage().items()} == used_before  # abort freed the staged memory
    (new,) = created
    assert new.state is InstanceState.RETIRED and new.ranks == []
    assert cluster.scale_events.running is None


def test_scale_up_hands_the_running_stream_over(cluster, baseline, monkeypatch):
    old = cluster.active
    routes = HandoverRoutes()
    started, result = threading.Event(), {}
    stream = threading.Thread(
        target=lambda: result.update(items=_run_stream(cluster, routes, "during-scale", started))
    )
    original_warm_up = Instance.warm_up

    def warm_up_then_start_stream(self: Instance) -> list[float]:
        # Start the request only once the new instance is warm: the switchover follows within
        # milliseconds, so the 1500-token request is surely in flight at the pause however
        # fast this machine decodes (starting it before the ~2 s standby boot was a race).
        out = original_warm_up(self)
        stream.start()
        assert started.wait(60)
        return out

    monkeypatch.setattr(Instance, "warm_up", warm_up_then_start_stream)
    event = Scaler(cluster, routes).scale(2)
    stream.join(120)
    items = result["items"]

    assert event.state is ScaleState.SUCCEEDED, event.error
    assert event.requests_in_flight == event.requests_handed_over == 1
    assert sum(isinstance(i, HandedOverOutput) for i in items) == 1
    assert _tokens(items) == baseline
    assert old.state is InstanceState.RETIRED and cluster.active.dp == 2 and cluster.active.is_serving
    assert cluster.hmm.layout.dp == 2 and len(cluster.router.loads()) == 2
    print(
        f"\nscaler DP1->DP2: {event.scale_latency_s:.2f}s, critical section {event.downtime_s * 1e3:.1f} ms"
    )
