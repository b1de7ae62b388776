"""`ClusterManager.start`: the first instance's ranks boot while the device workers start and the
model loads, and a start that fails on either side leaves nothing running (the HMM shut down,
every booted instance retired)."""

from __future__ import annotations

import threading
import types

import pytest
from elastic_server import tiny_config

import coordinator.cluster as cluster_module
import coordinator.node_pool as node_pool_module
from coordinator.nodes import DeviceNode
from imm.lifecycle import InstanceState

NODE = "a" * 56


class Stop(Exception):
    """Ends a start at the step after the one a test looks at."""


def raising(exc: BaseException):
    def step() -> None:
        raise exc

    return step


class FakeHMM:
    def __init__(self, log: list[str], booting: threading.Event, **kwargs) -> None:
        self.log, self.booting = log, booting
        self.devices: dict = {}
        self.layout = None

    def add_devices(self, specs) -> None:
        # NOTE: the device workers' start waits for the ranks' boot to begin: a start that boots
        # them only after its workers are up fails here instead of overlapping the two.
        assert self.booting.wait(10), "the ranks did not boot while the device workers started"
        self.devices.update({s.device_id: s for s in specs})
        self.log.append("devices")

    def shutdown(self) -> None:
        self.log.append("hmm shutdown")


class FakeInstance:
    def __init__(self, log: list[str], nodes: tuple) -> None:
        self.log, self.nodes, self.state = log, nodes, InstanceState.STANDBY

    def attach(self, hmm) -> None:
        self.log.append("attach")
        raise Stop

    def retire(self) -> None:
        self.state = InstanceState.RETIRED
        self.log.append("retired")


@pytest.fixture
def start(tiny_model_dir, monkeypatch):
    """`start(load=..., boot=...)`: `ClusterManager.start` on 2 devices at dp 1 with a fake HMM and
    instance; returns the log of what happened and the error the start raised."""
    monkeypatch.setattr(node_pool_module, "discover", lambda: [DeviceNode(NODE, "10.0.0.1", 2)])
    monkeypatch.setattr(node_pool_module.ray, "get_runtime_context", lambda: types.SimpleNamespace(get_node_id=lambda: NODE))

    def run(load=None, boot=None) -> tuple[list[str], BaseException]:
        log: list[str] = []
        booting = threading.Event()
        monkeypatch.setattr(cluster_module, "HMMController", lambda **kw: FakeHMM(log, booting, **kw))

        def create_instance(self, dp, devices, paced=False):
            booting.set()
            if boot is not None:
                boot()
            log.append(f"booted on devices {[d.device_id for d in devices]}")
            return FakeInstance(log, self.rank_nodes(devices))

        def load_model(self, dp):
            if load is not None:
                load()
            self.hmm.layout = types.SimpleNamespace(devices=tuple(self.hmm.devices.values())[:dp])
            log.append("loaded")

        monkeypatch.setattr(cluster_module.ClusterManager, "create_instance", create_instance)
        monkeypatch.setattr(cluster_module.ClusterManager, "load_model", load_model)
        cluster = cluster_module.ClusterManager(tiny_config(tiny_model_dir, num_devices=2, dp=1))
        with pytest.raises(BaseException) as failed:
            cluster.start()
        return log, failed.value

    return run


def test_the_ranks_boot_beside_the_device_workers_and_attach_to_the_loaded_model(start):
    log, error = start()
    assert isinstance(error, Stop)  # the start reached the attach of the booted instance
    assert "booted on devices [0]" in log and log.index("loaded") < log.index("attach")
    assert log[-2:] == ["retired", "hmm shutdown"]  # a start failing after that releases both


def test_a_failed_load_retires_the_ranks_booted_beside_it(start):
    def slow_boot():
        threading.Event().wait(0.2)  # still booting when the load fails

    log, error = start(load=raising(OSError("checkpoint unreadable")), boot=slow_boot)
    assert isinstance(error, OSError) and "attach" not in log
    assert log[-2:] == ["retired", "hmm shutdown"]


def test_a_failed_boot_fails_the_start_and_frees_the_devices(start):
    log, error = start(boot=raising(RuntimeError("rank process died")))
    assert isinstance(error, RuntimeError) and "rank process died" in str(error)
    assert "retired" not in log and log[-1] == "hmm shutdown"  # a failed boot retires its own ranks
