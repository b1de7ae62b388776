"""`elasticmoe make-lora-adapter`: write a PEFT-format LoRA adapter for a base
checkpoint, and the merged model (`W + scaling * B @ A` for every adapted
module) that serves as the correctness oracle for LoRA serving.

A and B are seeded Gaussians. Unlike training init, B is not zero: each
module's A and B share a std chosen so that ||scaling * B @ A||_F is about
`delta_scale` * ||W||_F, a visible but moderate change of the outputs.
"""

from __future__ import annotations

import json
import logging
import math
import os
from collections.abc import Sequence
from pathlib import Path

import torch
from safetensors.torch import save_file

from elasticmoe.adapters.lora import CONFIG_FILE, PREFIX, WEIGHTS_FILE, LoraAdapter, LoraConfig, lora_modules
from elasticmoe.config import ModelConfig
from elasticmoe.errors import AdapterError
from elasticmoe.models.weights import SafetensorsWeightProvider
from elasticmoe.tools.checkpoint import rewrite_checkpoint

logger = logging.getLogger(__name__)


def _base_config(base_dir: str | os.PathLike) -> ModelConfig:
    try:
        return ModelConfig.from_pretrained(base_dir)
    except (FileNotFoundError, ValueError, KeyError) as exc:
        raise AdapterError("base", f"{base_dir} is not a supported base checkpoint: {exc}") from exc


def _expert_of(module: str) -> int | None:
    parts = module.split(".")
    return int(parts[parts.index("experts") + 1]) if "experts" in parts else None


def _select(model: ModelConfig, config: LoraConfig, layers: Sequence[int] | None,
            experts: Sequence[int] | None) -> list[str]:
    """The adaptable modules of `model` matching the targets, layers and (for expert targets) experts."""
    if layers is not None:
        bad = [i for i in layers if not 0 <= i < model.num_layers]
        if bad or not layers:
            raise AdapterError("layers", f"want layer ids in [0, {model.num_layers}), got {list(layers)}")
    if experts is not None:
        bad = [e for e in experts if not 0 <= e < model.num_experts]
        if bad or not experts:
            raise AdapterError("experts", f"want expert ids in [0, {model.num_experts}), got {list(experts)}")
    chosen = []
    for module in lora_modules(model):
        layer, kind, expert = int(module.split(".")[2]), module.rsplit(".", 1)[1], _expert_of(module)
        if kind not in config.target_modules or (layers is not None and layer not in layers):
            continue
        if expert is not None and experts is not None and expert not in experts:
            continue
        chosen.append(module)
    if not chosen:
        raise AdapterError("layers", f"no module of {config.target_modules} in the chosen layers/experts")
    return chosen


def make_lora_adapter(
    base_dir: str | os.PathLike,
    out_dir: str | os.PathLike,
    *,
    rank: int = 8,
    alpha: float = 16,
    target_modules: Sequence[str] = ("q_proj", "v_proj"),
    layers: Sequence[int] | None = None,
    experts: Sequence[int] | None = None,
    seed: int = 0,
    delta_scale: float = 0.25,
    use_rslora: bool = False,
) -> Path:
    """Write `adapter_config.json` + `adapter_model.safetensors` (float32) to `out_dir` and return it.

    Adapts every base module named in `target_modules` in `layers` (default:
    all; expert targets only exist in MoE layers) and, for expert targets, of
    `experts` (default: all routed experts). Targets are the names of
    `elasticmoe.adapters.lora.lora_modules`: on DeepSeek-V2 `q_proj` (or
    `q_a_proj`/`q_b_proj`), `kv_a_proj_with_mqa`, `o_proj` and the experts';
    `kv_b_proj` raises `AdapterError` (it cannot be served, see `KV_B_PROJ_UNSUPPORTED`).
    """
    if not (math.isfinite(delta_scale) and delta_scale > 0):
        raise AdapterError("delta_scale", f"must be a finite number > 0, got {delta_scale}")
    try:
        config = LoraConfig(r=rank, lora_alpha=alpha, target_modules=tuple(dict.fromkeys(target_modules)),
                            use_rslora=use_rslora)
    except AdapterError as exc:
        raise AdapterError({"r": "rank", "lora_alpha": "alpha"}.get(exc.param, exc.param), exc.message) from None
    model = _base_config(base_dir)
    config.check_fits(model)
    modules = _select(model, config, layers, experts)

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(seed)
    base = SafetensorsWeightProvider(Path(base_dir))
    shapes = lora_modules(model)
    tensors = {}
    for module in modules:
        in_features, out_features = shapes[module]
        w_norm = base.read(f"{module}.weight").float().norm().item()
        # E||s * B @ A||_F^2 = s^2 * out * in * r * std^4 with A, B ~ N(0, std^2)
        std = math.sqrt(delta_scale * w_norm / (config.scaling * math.sqrt(out_features * in_features * rank)))
        tensors[f"{PREFIX}{module}.lora_A.weight"] = torch.randn(rank, in_features, generator=gen) * std
        tensors[f"{PREFIX}{module}.lora_B.weight"] = torch.randn(out_features, rank, generator=gen) * std
    base.close()
    save_file(tensors, str(out / WEIGHTS_FILE), metadata={"format": "pt"})
    (out / CONFIG_FILE).write_text(json.dumps(config.to_json(str(base_dir)), indent=2) + "\n")
    logger.info("wrote LoRA adapter %s: r=%d, %d modules (seed %d)", out, rank, len(modules), seed)
    return out


def write_lora_merged_model(base_dir: str | os.PathLike, adapter_dir: str | os.PathLike,
                            out_dir: str | os.PathLike) -> Path:
    """Write a full HF checkpoint equal to the base with `W + scaling * B @ A` for every adapted module.

    Non-weight files are copied; every safetensors shard is rewritten under the
    same name with the same tensor names (merged in float32, stored in the
    base's dtype), so the result loads anywhere the base does.
    """
    base, out = Path(base_dir), Path(out_dir)
    adapter = LoraAdapter.open("merged", adapter_dir, _base_config(base), base_dir=base)
    weights = {f"{module}.weight": module for module in adapter.modules}

    def merge(name: str, t: torch.Tensor) -> torch.Tensor | None:
        return t.float() + adapter.delta(weights[name]) if name in weights else None

    merged = rewrite_checkpoint(base, out, merge)
    adapter.close()
    assert merged == len(weights), "LoraAdapter.open(base_dir=...) checked every module is in the base"
    logger.info("wrote LoRA-merged model %s (%d modules from %s)", out, merged, adapter_dir)
    return out
