"""LoRA adapters in PEFT's on-disk format.

An adapter directory holds `adapter_config.json` (PEFT's `LoraConfig`) and
`adapter_model.safetensors` with one pair per adapted module:
`base_model.model.<module>.lora_A.weight` `[r, in]` and `.lora_B.weight`
`[out, r]`, where `<module>` is the base checkpoint's module path (its weight is
`<module>.weight`, `[out, in]`). The adapted weight is `W + scaling * B @ A`.

Adaptable modules are the attention projections and the routed experts' FFN
projections; which modules an adapter adapts is exactly the pairs in its file
(any subset of layers and experts). Dense MLPs, shared experts, the router,
embeddings and norms are not adaptable, nor is DeepSeek-V2's `kv_b_proj`
(see `KV_B_PROJ_UNSUPPORTED`).
"""

from __future__ import annotations

import json
import logging
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from elasticmoe.adapters.esft import _ST_DTYPES, _is_int, expert_tensors
from elasticmoe.adapters.kinds import LORA_CONFIG as CONFIG_FILE
from elasticmoe.config import ModelConfig
from elasticmoe.errors import AdapterError

logger = logging.getLogger(__name__)

WEIGHTS_FILE = "adapter_model.safetensors"
PREFIX = "base_model.model."
ATTENTION_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "q_a_proj", "q_b_proj", "kv_a_proj_with_mqa",
                     "kv_b_proj")
EXPERT_TARGETS = ("gate_proj", "up_proj", "down_proj", "w1", "w2", "w3")
KNOWN_TARGETS = frozenset(ATTENTION_TARGETS + EXPERT_TARGETS)
# PEFT fields that must be empty/false: (field, what we support)
# Why MLA's kv_b_proj is rejected rather than served (an AdapterError on `target_modules`, a 400).
KV_B_PROJ_UNSUPPORTED = (
    "kv_b_proj cannot be adapted on this DeepSeek-V2 (MLA) base: the KV cache holds the compressed latent "
    "and kv_b_proj is absorbed into the attention (keys and values are expanded from the cached latents, or "
    "folded into the query at decode), so a LoRA on it would have to be applied to every cached token of "
    "the request at every decode step; adapt q_proj (or q_a_proj/q_b_proj), kv_a_proj_with_mqa, o_proj "
    "and the routed experts instead"
)
_MUST_BE_EMPTY = ("modules_to_save", "rank_pattern", "alpha_pattern", "target_parameters", "layer_replication")
_MUST_BE_FALSE = ("fan_in_fan_out", "use_dora", "lora_bias")


@dataclass(frozen=True)
class LoraConfig:
    """The PEFT `LoraConfig` fields that matter for serving; `from_json` rejects the rest."""

    r: int
    lora_alpha: float
    target_modules: tuple[str, ...]
    use_rslora: bool = False
    layers_to_transform: tuple[int, ...] | None = None  # None: any layer

    def __post_init__(self) -> None:
        if not _is_int(self.r) or self.r < 1:
            raise AdapterError("r", f"must be an integer >= 1, got {self.r!r}")
        if (isinstance(self.lora_alpha, bool) or not isinstance(self.lora_alpha, int | float)
                or not math.isfinite(self.lora_alpha) or self.lora_alpha <= 0):
            raise AdapterError("lora_alpha", f"must be a finite number > 0, got {self.lora_alpha!r}")
        if not self.target_modules:
            raise AdapterError("target_modules", "must name at least one module")
        unknown = [t for t in self.target_modules if t not in KNOWN_TARGETS]
        if unknown:
            raise AdapterError("target_modules", f"unsupported modules {unknown} (supported: {sorted(KNOWN_TARGETS)})")
        if not isinstance(self.use_rslora, bool):
            raise AdapterError("use_rslora", f"expected a boolean, got {self.use_rslora!r}")
        if self.layers_to_transform is not None and any(not _is_int(i) or i < 0 for i in self.layers_to_transform):
            raise AdapterError("layers_to_transform", f"expected layer ids, got {list(self.layers_to_transform)}")

    @property
    def scaling(self) -> float:
        """alpha / r, or alpha / sqrt(r) with rsLoRA."""
        return self.lora_alpha / (math.sqrt(self.r) if self.use_rslora else self.r)

    @classmethod
    def from_json(cls, obj: Any) -> LoraConfig:
        if not isinstance(obj, dict):
            raise AdapterError("path", f"{CONFIG_FILE} must be a JSON object, got {type(obj).__name__}")
        if obj.get("peft_type") != "LORA":
            raise AdapterError("peft_type", f"only LORA adapters are supported, got {obj.get('peft_type')!r}")
        if obj.get("bias", "none") != "none":
            raise AdapterError("bias", f"only bias='none' is supported, got {obj['bias']!r}")
        for field in _MUST_BE_EMPTY:
            if obj.get(field):
                raise AdapterError(field, f"is not supported, got {obj[field]!r}")
        for field in _MUST_BE_FALSE:
            if obj.get(field, False) is not False:
                raise AdapterError(field, f"must be false, got {obj[field]!r}")
        targets = obj.get("target_modules")
        if not isinstance(targets, list) or any(not isinstance(t, str) for t in targets):
            # PEFT also allows a regex string or "all-linear"; only explicit names are supported
            raise AdapterError("target_modules", f"expected a list of module names, got {targets!r}")
        layers = obj.get("layers_to_transform")
        if _is_int(layers):
            layers = [layers]
        if layers is not None and not isinstance(layers, list):
            raise AdapterError("layers_to_transform", f"expected a layer id or a list of them, got {layers!r}")
        return cls(
            r=obj.get("r"),  # type: ignore[arg-type]  # validated in __post_init__
            lora_alpha=obj.get("lora_alpha"),  # type: ignore[arg-type]
            target_modules=tuple(dict.fromkeys(targets)),
            use_rslora=obj.get("use_rslora", False),
            layers_to_transform=None if layers is None else tuple(layers),
        )

    @classmethod
    def from_file(cls, path: str | os.PathLike) -> LoraConfig:
        try:
            obj = json.loads(Path(path).read_text())
        except OSError as exc:
            raise AdapterError("path", f"{path}: not readable") from exc
        except json.JSONDecodeError as exc:
            raise AdapterError("path", f"{path} is not valid JSON: {exc}") from exc
        return cls.from_json(obj)

    def to_json(self, base_model: str | None = None) -> dict[str, Any]:
        """PEFT's adapter_config.json fields (loads with `peft.PeftModel.from_pretrained`)."""
        return {
            "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_model,
            "r": self.r, "lora_alpha": self.lora_alpha, "target_modules": list(self.target_modules),
            "lora_dropout": 0.0, "bias": "none", "use_rslora": self.use_rslora, "fan_in_fan_out": False,
            "modules_to_save": None, "init_lora_weights": True, "inference_mode": True,
            "layers_to_transform": None if self.layers_to_transform is None else list(self.layers_to_transform),
            "rank_pattern": {}, "alpha_pattern": {}, "use_dora": False,
        }

    def check_fits(self, model: ModelConfig) -> None:
        """Every target names a module kind the base model has (and can serve LoRA on)."""
        if model.is_mla and "kv_b_proj" in self.target_modules:
            raise AdapterError("target_modules", KV_B_PROJ_UNSUPPORTED)
        kinds = {module.rsplit(".", 1)[1] for module in lora_modules(model)}
        missing = [t for t in self.target_modules if t not in kinds]
        if missing:
            raise AdapterError("target_modules", f"{missing} are not modules of this {model.arch} base model "
                               f"(it has {sorted(kinds)})")


def lora_modules(model: ModelConfig) -> dict[str, tuple[int, int]]:
    """Every adaptable module of `model`: base module path -> (in_features, out_features).

    Attention projections of every layer (MLA: those that act on each token alone, so
    not `kv_b_proj`), then the routed experts' projections (names from the engine's
    expert `ParamSpec`s, as ESFT adapters use them).
    """
    h, nh = model.hidden_size, model.num_heads
    attn: dict[str, tuple[int, int]]
    if not model.is_mla:
        q, kv = nh * model.head_dim, model.num_kv_heads * model.head_dim
        attn = {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h)}
    else:
        q = nh * (model.qk_nope_head_dim + model.qk_rope_head_dim)
        qr = model.q_lora_rank
        attn = {"q_proj": (h, q)} if qr is None else {"q_a_proj": (h, qr), "q_b_proj": (qr, q)}
        attn |= {
            "kv_a_proj_with_mqa": (h, model.kv_lora_rank + model.qk_rope_head_dim),
            "o_proj": (nh * model.v_head_dim, h),
        }
    out = {f"model.layers.{i}.self_attn.{n}": shape for i in range(model.num_layers) for n, shape in attn.items()}
    for t in expert_tensors(model).values():
        for name, (rows, cols) in t.shapes().items():
            out[name.removesuffix(".weight")] = (cols, rows)
    return out


def _layer_of(module: str) -> int:
    return int(module.split(".")[2])  # model.layers.{l}.…


def _read_headers(file: Path) -> dict[str, tuple[tuple[int, ...], str]]:
    try:
        with safe_open(str(file), framework="pt") as f:
            return {k: (tuple(f.get_slice(k).get_shape()), f.get_slice(k).get_dtype()) for k in f.keys()}
    except Exception as exc:  # safetensors raises its own error types for corrupt files
        raise AdapterError("path", f"cannot read {file.name}: {exc}") from exc


class LoraAdapter:
    """A validated PEFT LoRA adapter; A/B tensors are read lazily (mmap'd by safetensors).

    `modules` maps each adapted base module path to `(r, in_features, out_features)`.
    """

    def __init__(self, name: str, path: Path, config: LoraConfig, modules: dict[str, tuple[int, int, int]],
                 stored_dtype: dict[str, torch.dtype]) -> None:
        self.name = name
        self.path = path
        self.config = config
        self.modules = modules
        self._stored_dtype = stored_dtype  # tensor name -> dtype in the file
        self._handle: Any = None

    @classmethod
    def open(cls, name: str, path: str | os.PathLike, model_config: ModelConfig, max_rank: int | None = None,
             *, base_dir: str | os.PathLike | None = None) -> LoraAdapter:
        """Validate the adapter at `path` against the base model; raises `AdapterError`.

        Base shapes come from `model_config`; with `base_dir` they are also
        checked against the base checkpoint's safetensors headers.
        """
        root = Path(path)
        # NOTE: one message for a missing path, a file, or a directory without the files (see esft.py).
        if not all((root / file).is_file() for file in (CONFIG_FILE, WEIGHTS_FILE)):
            raise AdapterError("path", f"{root}: no PEFT LoRA adapter here (want a directory with {CONFIG_FILE} "
                               f"and {WEIGHTS_FILE})")
        config = LoraConfig.from_file(root / CONFIG_FILE)
        if max_rank is not None and config.r > max_rank:
            raise AdapterError("r", f"rank {config.r} is above the maximum rank {max_rank}")
        config.check_fits(model_config)
        base = lora_modules(model_config)
        if base_dir is not None:
            _check_base_shapes(base, Path(base_dir))

        headers = _read_headers(root / WEIGHTS_FILE)
        pairs: dict[str, dict[str, tuple[int, ...]]] = {}
        dtypes: dict[str, torch.dtype] = {}
        for key, (shape, st_dtype) in headers.items():
            module, _, which = key.removeprefix(PREFIX).rpartition(".lora_")
            if not key.startswith(PREFIX) or which not in ("A.weight", "B.weight"):
                raise AdapterError("path", f"unexpected tensor {key!r} (want {PREFIX}<module>.lora_A/B.weight)")
            if module not in base and module.endswith(".self_attn.kv_b_proj") and model_config.is_mla:
                raise AdapterError("target_modules", f"tensor {key!r}: {KV_B_PROJ_UNSUPPORTED}")
            if module not in base:
                raise AdapterError("path", f"tensor {key!r}: {module!r} is not an adaptable module of the base model "
                                   "(attention projections and routed experts only)")
            if module.rsplit(".", 1)[1] not in config.target_modules:
                raise AdapterError("target_modules", f"tensor {key!r} adapts a module not in {config.target_modules}")
            layers = config.layers_to_transform
            if layers is not None and _layer_of(module) not in layers:
                raise AdapterError("layers_to_transform", f"tensor {key!r} is outside layers {list(layers)}")
            if st_dtype not in _ST_DTYPES:
                raise AdapterError("path", f"tensor {key!r} has dtype {st_dtype}, expected one of {sorted(_ST_DTYPES)}")
            if len(shape) != 2:
                raise AdapterError("path", f"tensor {key!r} has shape {list(shape)}, expected a matrix")
            pairs.setdefault(module, {})[which[0]] = shape
            dtypes[key] = _ST_DTYPES[st_dtype]
        if not pairs:
            raise AdapterError("path", f"{WEIGHTS_FILE} holds no LoRA tensors")

        modules: dict[str, tuple[int, int, int]] = {}
        for module in sorted(pairs, key=lambda m: (_layer_of(m), m)):
            got = pairs[module]
            if len(got) != 2:
                have, lack = ("A", "B") if "A" in got else ("B", "A")
                raise AdapterError("path", f"{module}: has lora_{have} but no lora_{lack}")
            (ra, in_a), (out_b, rb) = got["A"], got["B"]
            in_features, out_features = base[module]
            if ra != config.r or rb != config.r:
                raise AdapterError("r", f"{module}: lora_A {list(got['A'])} / lora_B {list(got['B'])} "
                                   f"do not have rank r={config.r}")
            if (in_a, out_b) != (in_features, out_features):
                raise AdapterError("path", f"{module}: lora_A {list(got['A'])} / lora_B {list(got['B'])} do not fit "
                                   f"the base weight [{out_features}, {in_features}]")
            modules[module] = (config.r, in_features, out_features)
        logger.info("LoRA adapter %s: r=%d, %d modules (%s) from %s", name, config.r, len(modules),
                    ",".join(config.target_modules), root)
        return cls(name, root, config, modules, dtypes)

    def _read(self, key: str) -> torch.Tensor:
        if self._handle is None:
            self._handle = safe_open(str(self.path / WEIGHTS_FILE), framework="pt")
        return self._handle.get_tensor(key)

    def weights(self, module: str, dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(A [r, in], B [out, r]) of an adapted module, in `dtype` (default: as stored)."""
        if module not in self.modules:
            raise KeyError(f"adapter {self.name}: module {module!r} is not adapted")
        a, b = self._read(f"{PREFIX}{module}.lora_A.weight"), self._read(f"{PREFIX}{module}.lora_B.weight")
        return (a, b) if dtype is None else (a.to(dtype), b.to(dtype))

    def delta(self, module: str, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """scaling * B @ A `[out, in]`, computed in float32 and returned in `dtype`."""
        a, b = self.weights(module, torch.float32)
        return (self.config.scaling * (b @ a)).to(dtype)

    def nbytes(self, dtype: torch.dtype | None = None) -> int:
        """Bytes of all A and B tensors in `dtype` (default: as stored)."""
        total = 0
        for module, (r, in_features, out_features) in self.modules.items():
            for which, numel in (("A", r * in_features), ("B", out_features * r)):
                total += numel * (dtype or self._stored_dtype[f"{PREFIX}{module}.lora_{which}.weight"]).itemsize
        return total

    def close(self) -> None:
        self._handle = None

    def __getstate__(self) -> dict[str, Any]:
        # Picklable (e.g. sent to a Ray actor): the file handle is reopened lazily on the other side.
        return {**self.__dict__, "_handle": None}

    def __repr__(self) -> str:
        return f"LoraAdapter({self.name!r}, {str(self.path)!r}, r={self.config.r}, {len(self.modules)} modules)"


def _check_base_shapes(base: dict[str, tuple[int, int]], base_dir: Path) -> None:
    shapes: dict[str, tuple[int, ...]] = {}
    for file in sorted(base_dir.glob("*.safetensors")):
        shapes |= {k: shape for k, (shape, _) in _read_headers(file).items()}
    for module, (in_features, out_features) in base.items():
        got = shapes.get(f"{module}.weight")
        if got != (out_features, in_features):
            raise AdapterError("base", f"{base_dir}: {module}.weight is {got and list(got)}, "
                               f"its config implies [{out_features}, {in_features}]")
