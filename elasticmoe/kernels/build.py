"""Compile `csrc/*.cpp` for this CPU's ISA once and load it with ctypes.

The build is cached under `$ELASTICMOE_KERNEL_CACHE` (default `~/.cache/elasticmoe/kernels`),
keyed by source, flags and ISA, and written atomically (EP ranks may build at once). A missing
compiler or a failed build leaves the caller on its PyTorch fallback, logged once.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from concurrent.futures import ThreadPoolExecutor
from functools import cache
from pathlib import Path
from typing import Any

import torch  # loads PyTorch's libgomp first, so the kernels share its OpenMP runtime

from elasticmoe.utils.cpu_features import detect_cpu_features
from elasticmoe.utils.user_cache import user_cache_dir

logger = logging.getLogger(__name__)

_CSRC = Path(__file__).parent / "csrc"
_AVX512_BF16 = ["-DEMOE_AVX512", "-DEMOE_BF16DOT", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq",
                "-mavx512bf16", "-mfma"]
_ISA_FLAGS = {
    "amx": [*_AVX512_BF16, "-DEMOE_AMX", "-mamx-tile", "-mamx-bf16"],
    "avx512_bf16": _AVX512_BF16,
    "avx512": ["-DEMOE_AVX512", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mfma"],
    "avx2": ["-DEMOE_AVX2", "-mavx2", "-mfma"],
}


_loaded: list[ctypes.CDLL] = []
_num_threads = 0  # 0: OpenMP's default (PyTorch's thread count at each call)


def set_kernel_threads(num_threads: int) -> None:
    """Threads of every kernel's parallel regions from now on, whatever PyTorch's own count is
    (a decode step runs PyTorch's small ops on one thread and the kernels on all; see ModelRunner)."""
    global _num_threads
    _num_threads = num_threads
    for lib in _loaded:
        lib.emoe_set_num_threads(num_threads)


def kernel_threads() -> int:
    """The kernels' thread count as set by `set_kernel_threads` (0: not set)."""
    return _num_threads


def kernels_enabled() -> bool:
    return os.environ.get("ELASTICMOE_KERNELS", "1") not in ("0", "false", "off")


def _cache_dir() -> Path:
    return user_cache_dir("kernels", "ELASTICMOE_KERNEL_CACHE")


@cache
def load_kernel(name: str, isa: str | None = None) -> ctypes.CDLL | None:
    """`csrc/{name}.cpp` built for `isa` (default: this CPU's, see `CpuFeatures.kernel_isa`);
    None when kernels are off, the ISA has no build, or compiling fails."""
    isa = isa or detect_cpu_features().kernel_isa
    if not kernels_enabled() or isa not in _ISA_FLAGS:
        return None
    compiler = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if compiler is None:
        logger.warning("kernels: no C++ compiler found; %s runs on PyTorch ops", name)
        return None
    source = _CSRC / f"{name}.cpp"
    flags = ["-O3", "-shared", "-fPIC", "-fopenmp", "-std=c++17", *_ISA_FLAGS[isa]]
    sources = b"".join(f.read_bytes() for f in sorted(_CSRC.glob("*.[ch]*")))  # the source and vec.h
    key = hashlib.sha256(sources + " ".join([compiler, *flags]).encode()).hexdigest()[:16]
    target = _cache_dir() / f"{name}-{isa}-{key}.so"
    if not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
        os.close(fd)
        cmd = [compiler, *flags, "-o", tmp, str(source)]
        try:
            subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=300)
            os.replace(tmp, target)
        except (OSError, subprocess.SubprocessError) as exc:
            err = getattr(exc, "stderr", "") or exc
            logger.warning("kernels: building %s for %s failed; PyTorch ops instead: %s", name, isa, err)
            Path(tmp).unlink(missing_ok=True)
            return None
        logger.info("kernels: built %s for %s (%s)", name, isa, target)
    lib = ctypes.CDLL(str(target))
    if hasattr(lib, "emoe_set_num_threads"):
        lib.emoe_set_num_threads.argtypes = [ctypes.c_int]
        lib.emoe_set_num_threads(_num_threads)
        _loaded.append(lib)
    return lib


def prebuild_all() -> None:
    """Build every kernel (`csrc/*.cpp`) for this CPU that is not in the cache yet, several at
    once (each compiler is a process of its own), so that no request waits for one. Built on first
    use instead, a fresh host's (or a new pod's) first request to `serve --single` took 4.0 s,
    the next 27 ms. What fails to build stays on its PyTorch fallback, as at first use."""
    if not kernels_enabled():
        return
    names = sorted(path.stem for path in _CSRC.glob("*.cpp"))
    with ThreadPoolExecutor(max_workers=max(1, len(os.sched_getaffinity(0))), thread_name_prefix="kernel-build") as pool:
        list(pool.map(load_kernel, names))


def declare(lib: ctypes.CDLL, signatures: dict[str, list[Any]]) -> ctypes.CDLL:
    """`lib` with each named entry point's argument types set, and its result an int (every
    kernel entry point returns a status code)."""
    for name, argtypes in signatures.items():
        fn = getattr(lib, name)
        fn.argtypes = argtypes
        fn.restype = ctypes.c_int
    return lib


def bind_threads(num_threads: int) -> list[int] | None:
    """Pin OpenMP thread i (PyTorch's and the kernels') to the i-th CPU this process may use, when
    it may use exactly `num_threads` CPUs (its own share of the host). Returns the CPUs, or None
    (not pinned: more or fewer CPUs than threads, no kernel build, or ELASTICMOE_BIND_THREADS=0).
    See csrc/thread_affinity.cpp."""
    cpus = sorted(os.sched_getaffinity(0))
    if num_threads < 2 or len(cpus) != num_threads or os.environ.get("ELASTICMOE_BIND_THREADS") == "0":
        return None
    lib = load_kernel("thread_affinity")
    if lib is None:
        return None
    array = (ctypes.c_int * num_threads)(*cpus)
    pinned = lib.emoe_bind_threads(array, num_threads) == num_threads
    # The calling thread (OpenMP's master) is pinned only while it computes (`pinned_to`): threads
    # and processes it starts otherwise would inherit a single CPU.
    os.sched_setaffinity(0, cpus)
    return cpus if pinned else None


class pinned_to:
    """Pin the calling thread to `cpu` for a `with` block (None: no-op), then restore its CPUs."""

    def __init__(self, cpu: int | None) -> None:
        self.cpu = cpu
        self.saved: set[int] | None = None

    def __enter__(self) -> None:
        if self.cpu is not None:
            self.saved = os.sched_getaffinity(0)
            os.sched_setaffinity(0, {self.cpu})

    def __exit__(self, *exc: object) -> None:
        if self.saved is not None:
            os.sched_setaffinity(0, self.saved)
            self.saved = None


_NOT_PROFILED = contextlib.nullcontext()


def profiled(name: str) -> contextlib.AbstractContextManager:
    """`name` around a kernel call in torch.profiler's tables (ctypes calls have no name there), at
    no cost while no profiler runs (a record_function costs ~10 us, a decode step calls ~40 kernels)."""
    return torch.profiler.record_function(name) if torch.autograd.profiler._is_profiler_enabled else _NOT_PROFILED
