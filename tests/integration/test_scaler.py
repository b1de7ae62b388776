"""`Scaler` on a real cluster (tiny Qwen3-MoE, 4 logical devices, float32, no HTTP): a failure
injected before the switchover rolls back (HMM layout and memory exactly as before, the new
instance retired, the old one serving a running stream to the end with unchanged tokens), and
so does one injected in the switchover after the export (the old instance takes its request
back with its KV);
then a real DP1 -> DP2 scale hands the running stream over with unchanged tokens; then every
baseline and ablation strategy scales once with a stream in flight at the switchover:
tokens unchanged, memory back to exactly the layout's bytes."""

from __future__ import annotations

import secrets
import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from elastic_server import cluster_of, tiny_config

from coordinator.cluster import ClusterManager
from coordinator.scale_events import ScaleState
from coordinator.scaler import Scaler
from coordinator.strategies import STRATEGIES
from elasticmoe.engine.engine_request import EngineRequest
from elasticmoe.models.registry import model_family
from elasticmoe.outputs import RequestOutput
from elasticmoe.sampling_params import SamplingParams
from hmm.device_memory import DeviceMemory
from imm.handover import HandedOverOutput, spliced_stream
from imm.instance import Instance
from imm.lifecycle import InstanceState

pytestmark = pytest.mark.slow

PROMPT = [5, 6, 7, 8, 9, 10]
PARAMS = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)


@pytest.fixture(scope="module")
def cluster(tiny_model_dir) -> Iterator[ClusterManager]:
    with cluster_of(tiny_config(tiny_model_dir, num_devices=4, standby_pool=True)) as cl:
        yield cl


class StandbyBoots:
    """The pool's refill after each scale (dp-1 and dp+1 booted in the background), let through
    only where a test says so: most scales here never take from the pool, and on 2 cores the
    boots were a third of this module's CPU time. The tests that use the pool fill it first."""

    def __init__(self, cluster: ClusterManager) -> None:
        self.allowed = False
        self.calls = 0
        self._cluster = cluster

    def __call__(self, delay_s: float = 0.0) -> None:
        self.calls += 1
        if self.allowed:
            ClusterManager.prepare_standby(self._cluster, delay_s)


def _pool_standby(cluster: ClusterManager, dp: int) -> int:
    """Boot the pool's standby instances now (what a scale's refill does) and wait for them;
    the pool's hit count, to tell that the next scale took the one for `dp`."""
    ClusterManager.prepare_standby(cluster)
    cluster.wait_standby(120)
    assert dp in cluster.standby.pool
    return cluster.standby.num_hits


@pytest.fixture(autouse=True)
def standby_boots(cluster, monkeypatch) -> StandbyBoots:
    boots = StandbyBoots(cluster)
    monkeypatch.setattr(cluster, "prepare_standby", boots)
    return boots


def _run_stream(
    cluster: ClusterManager, rid: str, started: threading.Event
) -> list[Any]:
    assert cluster.active is not None
    items: list[Any] = []
    for item in spliced_stream(cluster.active.ranks[0].generate.remote(EngineRequest(rid, PROMPT, PARAMS))):
        items.append(item)
        if len(items) == 3:
            started.set()
    return items


def _during_scale(cluster: ClusterManager, rid: str, scale: Callable[[Scaler], Any]) -> tuple[Any, list[Any]]:
    """Run `scale(scaler)` while request `rid` streams; (its result, the stream's items)."""
    scaler = Scaler(cluster)
    started, result = threading.Event(), {}
    t = threading.Thread(target=lambda: result.update(items=_run_stream(cluster, rid, started)))
    t.start()
    assert started.wait(60)
    out = scale(scaler)
    t.join(120)
    return out, result["items"]


def _tokens(items: list[Any]) -> list[int]:
    outs = [i for i in items if isinstance(i, RequestOutput)]
    assert outs[-1].finished and [t for o in outs for t in o.new_token_ids] == outs[-1].output_token_ids
    return outs[-1].output_token_ids


def _stream_in_flight_at_pause(
    monkeypatch: pytest.MonkeyPatch, cluster: ClusterManager, rid: str
) -> tuple[threading.Thread, dict[str, Any]]:
    """A stream on the active instance that starts right before its `pause` (every strategy
    pauses the old instance exactly once), so it is surely in flight at the switchover."""
    old, started, result = cluster.active, threading.Event(), {}
    stream = threading.Thread(target=lambda: result.update(items=_run_stream(cluster, rid, started)))
    original_pause = Instance.pause

    def start_stream_then_pause(self: Instance) -> None:
        if self is old and not stream.is_alive():
            stream.start()
            assert started.wait(60)
        original_pause(self)

    monkeypatch.setattr(Instance, "pause", start_stream_then_pause)
    return stream, result


@pytest.fixture(scope="module")
def baseline(cluster) -> list[int]:
    started = threading.Event()
    return _tokens(_run_stream(cluster, "baseline", started))


def test_failure_before_switchover_rolls_back(cluster, baseline, monkeypatch, standby_boots):
    standby_boots.allowed = True
    hmm, old = cluster.hmm, cluster.active
    cluster.wait_standby()  # the pool's background boots allocate no HMM memory, but settle first
    used_before = {d: u.used for d, u in hmm.usage().items()}
    created: list[Instance] = []

    def failing_warm_up(self: Instance) -> list[float]:
        created.append(self)
        raise RuntimeError("injected warm-up failure")

    monkeypatch.setattr(Instance, "warm_up", failing_warm_up)
    event, items = _during_scale(cluster, "during-failed-scale", lambda s: s.scale(2))

    assert event.state is ScaleState.ROLLED_BACK and "injected warm-up failure" in event.error
    assert event.downtime_s is None  # the gate never closed
    assert not any(isinstance(i, HandedOverOutput) for i in items)
    assert _tokens(items) == baseline  # the old instance kept serving it
    assert cluster.active is old and old.is_serving and cluster.routing.is_accepting
    assert hmm.pending is None and hmm.layout.dp == 1
    assert {d: u.used for d, u in hmm.usage().items()} == used_before  # abort freed the staged memory
    (new,) = created
    assert new.state is InstanceState.RETIRED and new.ranks == []
    assert cluster.scale_events.running is None
    cluster.wait_standby(120)  # the pool is refilled after a rollback too: the next scale finds it warm
    assert 2 in cluster.standby.pool


def test_failure_in_the_switchover_hands_the_requests_back(cluster, baseline, monkeypatch):
    hmm, old = cluster.hmm, cluster.active
    cluster.wait_standby()
    used_before = {d: u.used for d, u in hmm.usage().items()}
    stream, result = _stream_in_flight_at_pause(monkeypatch, cluster, "during-failed-switchover")
    imported: list[Instance] = []
    original_import = Instance.import_requests

    def import_then_fail(self: Instance, *args: Any, **kwargs: Any) -> dict[str, Any]:
        # The harsh case: the new instance already took the request (and may step it) when
        # the switchover fails; the undo must retire it before the old one runs again.
        original_import(self, *args, **kwargs)
        imported.append(self)
        raise RuntimeError("injected import failure")

    monkeypatch.setattr(Instance, "import_requests", import_then_fail)
    event = Scaler(cluster).scale(2)
    stream.join(120)
    items = result["items"]

    assert event.state is ScaleState.ROLLED_BACK, event.error
    assert "rolled back at switchover" in event.error and "injected import failure" in event.error
    assert event.requests_in_flight == 1 and event.downtime_s is not None
    assert sum(isinstance(i, HandedOverOutput) for i in items) == 1  # exported, then taken back
    assert _tokens(items) == baseline  # continued on the old instance with its KV, unchanged
    (new,) = imported
    assert new.state is InstanceState.RETIRED
    assert cluster.active is old and old.is_serving and not old.is_paused and cluster.routing.is_accepting
    assert hmm.pending is None and hmm.layout.dp == 1
    assert {d: u.used for d, u in hmm.usage().items()} == used_before
    assert cluster.scale_events.running is None


def test_scale_up_hands_the_running_stream_over(cluster, baseline, monkeypatch):
    hits = _pool_standby(cluster, 2)
    old = cluster.active
    started, result = threading.Event(), {}
    stream = threading.Thread(
        target=lambda: result.update(items=_run_stream(cluster, "during-scale", started))
    )
    original_warm_up = Instance.warm_up

    def warm_up_then_start_stream(self: Instance) -> list[float]:
        # Start the request only once the new instance is warm: the switchover follows within
        # milliseconds, so the 200-token request is surely in flight at the pause however
        # fast this machine decodes (starting it before the ~2 s standby boot was a race).
        out = original_warm_up(self)
        stream.start()
        assert started.wait(60)
        return out

    monkeypatch.setattr(Instance, "warm_up", warm_up_then_start_stream)
    event = Scaler(cluster).scale(2)
    stream.join(120)
    items = result["items"]

    assert event.state is ScaleState.SUCCEEDED, event.error
    assert cluster.standby.num_hits == hits + 1  # the pre-initialised instance took over
    assert event.requests_in_flight == event.requests_handed_over == 1
    assert sum(isinstance(i, HandedOverOutput) for i in items) == 1
    assert _tokens(items) == baseline
    assert old.state is InstanceState.RETIRED and cluster.active.dp == 2 and cluster.active.is_serving
    assert cluster.hmm.layout.dp == 2 and len(cluster.routing.ranks) == 2
    print(
        f"\nscaler DP1->DP2: {event.scale_latency_s:.2f}s, critical section {event.downtime_s * 1e3:.1f} ms"
    )


def _held_bytes(hmm: Any, device_id: int) -> int:
    """What a device holding exactly the committed layout's tensors is charged: staged once
    on a scratch `DeviceMemory` in this process (page rounding included), then freed."""
    layout, cfg = hmm.layout, hmm.model_config
    specs = model_family(cfg.arch).param_specs(cfg, layout.local_experts(device_id))
    scratch = DeviceMemory(device_id, 1 << 40, prefix=f"emoescratch{secrets.token_hex(4)}")
    try:
        scratch.begin(specs, hmm.dtype, layout.kv_bytes[layout.rank_of(device_id)])
        return scratch.account.used
    finally:
        scratch.close()


# Each scale leaves the cluster at the next one's starting dp. extravagant needs from + to
# free devices (4 registered); cold_restart reloads from disk with the gate closed.
TOUR = [
    ("cold_restart", 1),
    ("concurrent", 2),
    ("extravagant", 1),
    ("no_ipc_alloc", 2),
    ("no_p2p", 3),
    ("no_preinit", 2),
    ("no_zero_copy", 1),
    ("elastic", 2),
]


@pytest.mark.parametrize(("strategy", "to_dp"), TOUR, ids=[name for name, _ in TOUR])
def test_every_strategy_hands_a_running_stream_over(cluster, baseline, monkeypatch, standby_boots, strategy, to_dp):
    hits = _pool_standby(cluster, to_dp) if STRATEGIES[strategy].preinit else None  # it takes from the pool
    old, hmm = cluster.active, cluster.hmm
    stream, result = _stream_in_flight_at_pause(monkeypatch, cluster, f"during-{strategy}")
    event = Scaler(cluster).scale(to_dp, strategy)
    stream.join(120)

    assert event.state is ScaleState.SUCCEEDED, event.error
    assert event.strategy == strategy and event.requests_in_flight == event.requests_handed_over == 1
    if hits is not None:
        assert cluster.standby.num_hits == hits + 1
    assert standby_boots.calls >= 1  # the scale asked for the pool's refill (held back here)
    assert _tokens(result["items"]) == baseline
    new = cluster.active
    assert old.state is InstanceState.RETIRED and new.dp == to_dp and new.is_serving
    layout = hmm.layout
    assert hmm.pending is None and layout.dp == to_dp and len(cluster.routing.ranks) == to_dp
    if strategy == "extravagant":
        assert not set(layout.device_ids) & set(old.device_ids)
    # Nothing of the old layout or of a second copy survives the commit.
    used = {d: u.used for d, u in hmm.usage().items()}
    assert used == {d: _held_bytes(hmm, d) if d in layout.device_ids else 0 for d in used}
    assert event.peak_memory_bytes >= sum(used.values())
    print(f"\n{strategy} {event.from_dp}->{to_dp}: {event.scale_latency_s:.2f}s, "
          f"downtime {event.downtime_s * 1e3:.0f} ms, peak {event.peak_memory_bytes / 2**20:.1f} MiB")
