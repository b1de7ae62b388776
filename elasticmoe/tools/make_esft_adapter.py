"""`elasticmoe make-esft-adapter`: write an ESFT adapter for a base checkpoint,
and the merged model (base with the adapter's experts swapped in) that serves as
the correctness oracle for adapter serving.

Tuned experts are the base experts plus seeded Gaussian noise scaled by each
tensor's std, so an adapter's outputs differ visibly from the base model's.
"""

from __future__ import annotations

import json
import logging
import math
import os
from pathlib import Path

import torch
from safetensors.torch import save_file

from elasticmoe.adapters.esft import EsftAdapter, EsftConfig, expert_tensors
from elasticmoe.adapters.kinds import EXPERT_CFG
from elasticmoe.config import ModelConfig
from elasticmoe.errors import AdapterError
from elasticmoe.models.weights import SafetensorsWeightProvider
from elasticmoe.tools.checkpoint import rewrite_checkpoint

logger = logging.getLogger(__name__)

ADAPTER_FILE = "adapter_model.safetensors"


def _base_config(base_dir: str | os.PathLike) -> ModelConfig:
    try:
        return ModelConfig.from_pretrained(base_dir)
    except (FileNotFoundError, ValueError, KeyError) as exc:
        raise AdapterError("base", f"{base_dir} is not a supported base checkpoint: {exc}") from exc


def _random_config(model: ModelConfig, experts_per_layer: int, gen: torch.Generator) -> EsftConfig:
    if not 1 <= experts_per_layer <= model.num_experts:
        raise AdapterError("experts_per_layer", f"must be in [1, {model.num_experts}], got {experts_per_layer}")
    experts = {
        layer: tuple(sorted(torch.randperm(model.num_experts, generator=gen)[:experts_per_layer].tolist()))
        for layer in model.moe_layer_ids
    }
    return EsftConfig(experts)


def make_esft_adapter(
    base_dir: str | os.PathLike,
    out_dir: str | os.PathLike,
    *,
    config: EsftConfig | None = None,
    experts_per_layer: int | None = None,
    seed: int = 0,
    noise: float = 0.05,
    fit: bool = False,
) -> Path:
    """Write `expert_cfg.json` + `adapter_model.safetensors` to `out_dir` and return it.

    The tuned experts come from `config` (with `fit`, folded onto the base via
    `EsftConfig.fitted_to`) or are `experts_per_layer` random distinct experts
    per MoE layer. Tensors keep the base's names and dtype.
    """
    if (config is None) == (experts_per_layer is None):
        raise AdapterError("config", "give exactly one of config or experts_per_layer")
    if not (math.isfinite(noise) and noise >= 0):
        raise AdapterError("noise", f"must be a finite number >= 0, got {noise}")
    model = _base_config(base_dir)
    gen = torch.Generator().manual_seed(seed)
    if config is None:
        assert experts_per_layer is not None
        config = _random_config(model, experts_per_layer, gen)
    elif fit:
        config = config.fitted_to(model)
    config.check_supported()
    config.check_fits(model)
    if not config.experts:
        raise AdapterError("config", "no experts left to tune on this base model")

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    stale = [p.name for p in out.glob("*.safetensors") if p.name != ADAPTER_FILE]
    if stale:
        raise AdapterError("out", f"{out} already holds other safetensors files {stale}")
    base = SafetensorsWeightProvider(Path(base_dir))
    layout = expert_tensors(model)
    tensors = {}
    for layer, ids in config.experts.items():
        for e in ids:
            t = layout[layer, e]
            for name in (*t.w13, *t.w2):
                w = base.read(name)
                w32 = w.float()
                delta = torch.randn(w32.shape, generator=gen) * (noise * w32.std())
                tensors[name] = (w32 + delta).to(w.dtype).contiguous()
    base.close()
    save_file(tensors, str(out / ADAPTER_FILE), metadata={"format": "pt"})
    (out / EXPERT_CFG).write_text(json.dumps(config.to_json(), indent=1) + "\n")
    logger.info("wrote adapter %s: %d experts over %d layers (seed %d, noise %g)", out,
                config.num_experts_total, len(config.experts), seed, noise)
    return out


def write_merged_model(base_dir: str | os.PathLike, adapter_dir: str | os.PathLike,
                       out_dir: str | os.PathLike) -> Path:
    """Write a full HF checkpoint equal to the base with the adapter's experts swapped in.

    Non-weight files (config, generation config, tokenizer, index) are copied;
    every safetensors shard is rewritten under the same name with the same
    tensor names, so the result loads anywhere the base does.
    """
    base, out = Path(base_dir), Path(out_dir)
    adapter = EsftAdapter.open("merged", adapter_dir, _base_config(base))
    replacements = dict(adapter.iter_tensors())
    replaced = rewrite_checkpoint(base, out, lambda name, _: replacements.get(name))
    adapter.close()
    if replaced != len(replacements):
        raise AdapterError("base", f"only {replaced} of the adapter's {len(replacements)} tensors are in {base}")
    logger.info("wrote merged model %s (%d tensors from adapter %s)", out, replaced, adapter_dir)
    return out
