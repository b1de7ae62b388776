"""The scaler's use of the old instance's expert load (`Scaler._expert_load`, `_warm_expert_caches`):
an optimisation, so a rank that cannot answer or a warm-up that fails never fails the scale."""

from __future__ import annotations

import types

import numpy as np

from coordinator.scale_events import ScaleEvent
from coordinator.scaler import Scaler


class Instance:
    def __init__(self, load=None, fail: bool = False) -> None:
        self.load, self.fail, self.warmed = load, fail, None

    def expert_load(self):
        if self.fail:
            raise RuntimeError("rank died")
        return self.load

    def warm_expert_caches(self, load):
        if self.fail:
            raise RuntimeError("rank died")
        self.warmed = load
        return int((load > 0).sum())


def scaler(offloads: bool = True) -> Scaler:
    return Scaler(types.SimpleNamespace(config=types.SimpleNamespace(offloads_experts=offloads)))  # type: ignore[arg-type]


def event() -> ScaleEvent:
    return ScaleEvent("scale-1", 2, 1, "elastic")


def test_the_old_instances_load_is_used_only_when_it_routed_something():
    load = np.array([[3, 0], [1, 2]])
    assert (scaler()._expert_load(event(), Instance(load)) == load).all()
    assert scaler()._expert_load(event(), Instance(np.zeros((2, 2)))) is None  # nothing routed yet
    assert scaler()._expert_load(event(), Instance(None)) is None  # no native engine (vLLM)
    assert scaler()._expert_load(event(), Instance(fail=True)) is None  # a dead rank: count-balanced


def test_warming_reports_the_rows_and_a_failure_leaves_the_caches_to_fill_on_demand():
    load, e = np.array([[3, 0], [1, 2]]), event()
    new = Instance()
    scaler()._warm_expert_caches(e, new, load)
    assert e.expert_rows_warmed == 3 and new.warmed is load
    failed = event()
    scaler()._warm_expert_caches(failed, Instance(fail=True), load)
    assert failed.expert_rows_warmed is None
    resident = event()
    scaler(offloads=False)._warm_expert_caches(resident, Instance(), load)  # no caches to warm
    assert resident.expert_rows_warmed is None
