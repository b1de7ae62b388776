"""ElasticMoE core: config, models, layers, engine, adapters, cli.

`LLM`, `RequestOutput` and `SamplingParams` load on first use: importing a light submodule
(the CLI, the errors) must not import torch, which costs ~2 CPU-s and ~180 MB in a process
that only needs those (`elasticmoe drain-node` in a pod's preStop hook, on a node that is
still serving)."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from elasticmoe.llm import LLM
    from elasticmoe.outputs import RequestOutput
    from elasticmoe.sampling_params import SamplingParams

__all__ = ["LLM", "RequestOutput", "SamplingParams"]

_HOMES = {"LLM": "elasticmoe.llm", "RequestOutput": "elasticmoe.outputs", "SamplingParams": "elasticmoe.sampling_params"}


def __getattr__(name: str) -> Any:
    if name not in _HOMES:
        raise AttributeError(f"module 'elasticmoe' has no attribute {name!r}")
    return getattr(importlib.import_module(_HOMES[name]), name)
