"""The environment a local Ray started by the elastic server gets: Serve's control loop at 0.5 s
unless the operator chose otherwise."""

from __future__ import annotations

from coordinator.launch import LOCAL_RAY_DEFAULTS, apply_local_ray_defaults


def test_defaults_fill_only_what_the_environment_leaves_unset():
    environ = {"PATH": "/bin"}
    apply_local_ray_defaults(environ)
    assert environ == {"PATH": "/bin", "RAY_SERVE_CONTROL_LOOP_INTERVAL_S": "0.5"}
    assert LOCAL_RAY_DEFAULTS == {"RAY_SERVE_CONTROL_LOOP_INTERVAL_S": "0.5"}

    chosen = {"RAY_SERVE_CONTROL_LOOP_INTERVAL_S": "0.1"}  # the operator's value wins
    apply_local_ray_defaults(chosen)
    assert chosen == {"RAY_SERVE_CONTROL_LOOP_INTERVAL_S": "0.1"}
