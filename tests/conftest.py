"""Shared fixtures: tiny checkpoints of each architecture, built once per session."""

from __future__ import annotations

import gc
import os
import secrets

import pytest
import torch

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

# Ray's and Serve's periodic background work, for every cluster the tests start (in-process,
# `ray start`, CLI subprocesses: they inherit this environment). On 2 cores the suite is bound by
# CPU, and an idle elastic server at dp 1 burnt 0.19 of a core (5.7 CPU-s per 30 s), a third of it
# Serve's 10 Hz control loop and Ray's per-process task-event, metrics and event-loop reporting,
# none of which a test reads (the tests' Prometheus scrapes the server's own /metrics). These make
# it 0.13, and two scaling modules 8% cheaper (256 -> 235 CPU-s). Production keeps Ray's defaults
# but for Serve's control loop, which a local Ray of the elastic server runs at 0.5 s too
# (`coordinator.launch.LOCAL_RAY_DEFAULTS`), as it caps glibc's malloc arenas. Each node's log
# monitor lists the session's log files at every 0.1 s poll while there are fewer than its
# threshold of them; at 0 it lists them every 0.5 s (0.011 -> 0.005 of a core per node; the tests
# read no forwarded worker log).
for _name, _value in (("RAY_SERVE_CONTROL_LOOP_INTERVAL_S", "0.5"), ("RAY_task_events_report_interval_ms", "0"),
                      ("RAY_metrics_report_interval_ms", "600000"), ("RAY_event_stats", "0"),
                      ("RAY_LOG_MONITOR_MANY_FILES_THRESHOLD", "0"), ("MALLOC_ARENA_MAX", "2")):
    os.environ.setdefault(_name, _value)

ARCHS = ("qwen3_moe", "mixtral", "deepseek_v2")


@pytest.fixture(scope="session")
def tiny_model_dirs(tmp_path_factory) -> dict[str, str]:
    """arch -> directory of a tiny checkpoint made by `elasticmoe make-model`."""
    from elasticmoe.tools.make_model import make_model

    root = tmp_path_factory.mktemp("models")
    return {arch: str(make_model(arch, "tiny", seed=0, out=str(root / arch))) for arch in ARCHS}


@pytest.fixture(scope="session")
def tiny_bf16_model_dirs(tiny_model_dirs, tmp_path_factory) -> dict[str, str]:
    """arch -> the tiny checkpoint stored in bf16 (as real checkpoints are)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    root = tmp_path_factory.mktemp("models-bf16")
    dirs = {}
    for arch, src in tiny_model_dirs.items():
        dirs[arch] = str(root / arch)
        AutoModelForCausalLM.from_pretrained(src, dtype=torch.bfloat16).save_pretrained(dirs[arch])
        AutoTokenizer.from_pretrained(src).save_pretrained(dirs[arch])
    return dirs


@pytest.fixture(scope="session")
def tiny_model_dir(tiny_model_dirs) -> str:
    return tiny_model_dirs["qwen3_moe"]


@pytest.fixture(scope="module")
def paced_engines():
    """The engines of every server the module starts step at most 50 times a second (a 200-token
    stream lasts >= 4 s). For the modules that keep clients streaming back to back while they scale,
    drain or kill: the load is there to have requests in flight at every event, and at full speed
    it kept 1.6 of the 2 cores busy while it ran, which the other test worker needs. Set
    before the module's Ray nodes start: their processes inherit it."""
    from elasticmoe.engine.async_llm import MIN_STEP_INTERVAL_ENV

    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(MIN_STEP_INTERVAL_ENV, "0.02")
        yield


@pytest.fixture
def shm_prefix():
    """A /dev/shm prefix of the test's own, and a check that no file with it is left after."""
    from hmm.memory import list_segments

    prefix = f"emoetest{secrets.token_hex(4)}"
    yield prefix
    gc.collect()
    assert list_segments(prefix) == [], "shared-memory files leaked"
