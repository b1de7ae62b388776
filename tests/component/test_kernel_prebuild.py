"""An engine builds its kernels before it serves, not in a request's forward: on a fresh kernel
cache every kernel source is compiled by `prebuild_all` (which `ModelRunner` calls); a compiler
that fails leaves the PyTorch fallbacks and raises nothing; with kernels off nothing is built."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from elasticmoe.kernels import build

PREBUILD = "from elasticmoe.kernels.build import prebuild_all; prebuild_all(); print('ok')"


def _prebuild(cache: Path, **env: str) -> subprocess.CompletedProcess:
    # A process of its own: `load_kernel` caches what it loaded for the life of a process.
    return subprocess.run([sys.executable, "-c", PREBUILD], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "ELASTICMOE_KERNEL_CACHE": str(cache), **env})


def test_a_fresh_cache_gets_every_kernel(tmp_path):
    if build.load_kernel("thread_affinity") is None:
        pytest.skip("no C++ compiler or kernel build for this CPU")
    done = _prebuild(tmp_path)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr
    built = {p.name.split("-")[0] for p in tmp_path.glob("*.so")}
    assert built == {p.stem for p in Path(build.__file__).with_name("csrc").glob("*.cpp")}


def test_a_failing_compiler_leaves_the_fallbacks(tmp_path):
    done = _prebuild(tmp_path, CXX="/bin/false")
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr
    assert not list(tmp_path.glob("*.so"))


def test_with_kernels_off_nothing_is_built(tmp_path):
    done = _prebuild(tmp_path, ELASTICMOE_KERNELS="0")
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr
    assert not tmp_path.exists() or not list(tmp_path.iterdir())
