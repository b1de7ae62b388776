"""A local Ray started by the elastic server (or a test module, or a bench): its environment
(Serve's control loop at 0.5 s, glibc's malloc at two arenas, OpenMP threads that spin briefly and
then sleep when they wait, unless the operator chose otherwise),
and a start that misses Ray's own deadlines is made again once, while one refused for its
arguments is not."""

from __future__ import annotations

import logging

import pytest

from coordinator.launch import LOCAL_RAY_DEFAULTS, apply_local_ray_defaults
from hmm.local_ray import init_local_ray


def test_defaults_fill_only_what_the_environment_leaves_unset():
    environ = {"PATH": "/bin"}
    apply_local_ray_defaults(environ)
    defaults = {"RAY_SERVE_CONTROL_LOOP_INTERVAL_S": "0.5", "MALLOC_ARENA_MAX": "2", "OMP_WAIT_POLICY": "PASSIVE",
                "GOMP_SPINCOUNT": "10000"}
    assert environ == {"PATH": "/bin", **defaults}
    assert LOCAL_RAY_DEFAULTS == defaults

    chosen = {"RAY_SERVE_CONTROL_LOOP_INTERVAL_S": "0.1", "MALLOC_ARENA_MAX": "4", "OMP_WAIT_POLICY": "ACTIVE",
              "GOMP_SPINCOUNT": "0"}
    apply_local_ray_defaults(chosen)  # the operator's values win
    assert chosen == {"RAY_SERVE_CONTROL_LOOP_INTERVAL_S": "0.1", "MALLOC_ARENA_MAX": "4", "OMP_WAIT_POLICY": "ACTIVE",
                      "GOMP_SPINCOUNT": "0"}


class FakeRay:
    """`ray.init` / `ray.shutdown` stand-ins: `init` raises the given errors in turn, then starts."""

    def __init__(self, *errors: Exception) -> None:
        self.errors = list(errors)
        self.calls: list[str] = []

    def init(self, **kwargs) -> None:
        self.calls.append(f"init {kwargs}")
        if self.errors:
            raise self.errors.pop(0)

    def shutdown(self) -> None:
        self.calls.append("shutdown")


def test_a_start_that_timed_out_is_made_once_more(caplog):
    ray = FakeRay(RuntimeError("Failed to get node info ... Deadline Exceeded"))
    with caplog.at_level(logging.WARNING, logger="hmm.local_ray"):
        init_local_ray(init=ray.init, shutdown=ray.shutdown, num_cpus=2)
    first = "init {'address': 'local', 'include_dashboard': False, 'num_cpus': 2}"
    assert ray.calls == [first, "shutdown", first]
    assert "starting it again (attempt 2 of 2)" in caplog.text and "Deadline Exceeded" in caplog.text


def test_the_second_failure_is_the_callers():
    ray = FakeRay(Exception("The current node timed out during startup"), RuntimeError("again"))
    with pytest.raises(RuntimeError, match="again"):
        init_local_ray(init=ray.init, shutdown=ray.shutdown)
    assert [c.split()[0] for c in ray.calls] == ["init", "shutdown", "init"]


def test_arguments_ray_refuses_are_not_retried():
    ray = FakeRay(TypeError("unexpected keyword argument 'num_cpu'"))
    with pytest.raises(TypeError, match="num_cpu"):
        init_local_ray(init=ray.init, shutdown=ray.shutdown, num_cpu=2)
    assert len(ray.calls) == 1
