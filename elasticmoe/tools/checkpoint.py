"""Rewrite an HF checkpoint with some tensors changed (the merged-model references of the
adapter tests and benchmarks)."""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from elasticmoe.errors import AdapterError


def rewrite_checkpoint(base: Path, out: Path, change: Callable[[str, torch.Tensor], torch.Tensor | None]) -> int:
    """Copy `base` to `out`: non-weight files as they are, every safetensors shard under the same
    name, tensor names and metadata, with `change(name, tensor)` (None: unchanged) stored in the
    base's dtype. Returns how many tensors changed."""
    if out.resolve() == base.resolve():
        raise AdapterError("out", "the merged model must not overwrite the base checkpoint")
    out.mkdir(parents=True, exist_ok=True)
    for src in sorted(base.iterdir()):
        if src.is_file() and src.suffix != ".safetensors":
            shutil.copy2(src, out / src.name)
    changed = 0
    for shard in sorted(base.glob("*.safetensors")):
        with safe_open(str(shard), framework="pt") as f:
            metadata = f.metadata()
            tensors = {}
            for name in f.keys():
                t = f.get_tensor(name)
                new = change(name, t)
                if new is not None:
                    t = new.to(t.dtype).contiguous()
                    changed += 1
                tensors[name] = t
        save_file(tensors, str(out / shard.name), metadata=metadata)
    return changed
