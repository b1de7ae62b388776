"""Model family lookup: arch name -> module with `param_specs`, `kv_token_shape`, `build`."""

from __future__ import annotations

from types import ModuleType

from elasticmoe.models import deepseek_v2, mixtral, qwen3_moe

_FAMILIES: dict[str, ModuleType] = {"qwen3_moe": qwen3_moe, "mixtral": mixtral, "deepseek_v2": deepseek_v2}


def model_family(arch: str) -> ModuleType:
    if arch not in _FAMILIES:
        raise ValueError(f"model_type: {arch!r} is not supported (supported: {', '.join(_FAMILIES)})")
    return _FAMILIES[arch]
