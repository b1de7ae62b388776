"""Where ElasticMoE keeps what it builds once per machine (kernel builds, tokenizer backends)."""

from __future__ import annotations

import os
from pathlib import Path


def user_cache_dir(name: str, env_var: str) -> Path:
    """`$env_var` if set, else `~/.cache/elasticmoe/<name>`."""
    return Path(os.environ.get(env_var) or Path.home() / ".cache" / "elasticmoe" / name)
