"""ESFT adapters in the ESFT repository's on-disk format.

An adapter directory holds `expert_cfg.json` (`{"experts": {"<layer>": [ids]},
"shared_experts": bool, "non_expert_modules": bool}`) and one or more
`*.safetensors` files with ONLY the tuned experts' tensors, under the base
model's own checkpoint names. Those names are not hardcoded per family: they
come from the engine's stacked expert `ParamSpec`s (`layers.{l}.moe.w13` /
`layers.{l}.moe.w2`), so an adapter expert loads exactly like a base expert.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from elasticmoe.adapters.kinds import EXPERT_CFG
from elasticmoe.config import ModelConfig
from elasticmoe.errors import AdapterError

logger = logging.getLogger(__name__)

_ST_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}


_INNER = "model."  # `model.model`'s prefix in a checkpoint's tensor names


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


@dataclass(frozen=True)
class EsftConfig:
    """Which routed experts an adapter tunes: layer -> expert ids (file order, no duplicates).

    Layers are kept in ascending order; layers with no tuned experts are absent.
    """

    experts: dict[int, tuple[int, ...]]
    shared_experts: bool = False
    non_expert_modules: bool = False

    def __post_init__(self) -> None:
        for layer, ids in self.experts.items():
            if not _is_int(layer) or layer < 0:
                raise AdapterError("experts", f"layer {layer!r} is not a non-negative integer")
            if not ids or any(not _is_int(e) or e < 0 for e in ids):
                raise AdapterError("experts", f"layer {layer}: expert ids must be non-negative integers, got {ids!r}")
            if len(set(ids)) != len(ids):
                raise AdapterError("experts", f"layer {layer}: duplicate expert ids {ids!r}")
        if not isinstance(self.shared_experts, bool):
            raise AdapterError("shared_experts", f"expected a boolean, got {self.shared_experts!r}")
        if not isinstance(self.non_expert_modules, bool):
            raise AdapterError("non_expert_modules", f"expected a boolean, got {self.non_expert_modules!r}")

    @classmethod
    def from_json(cls, obj: Any) -> EsftConfig:
        if not isinstance(obj, dict):
            raise AdapterError("experts", f"{EXPERT_CFG} must be a JSON object, got {type(obj).__name__}")
        raw = obj.get("experts")
        if not isinstance(raw, dict):
            raise AdapterError("experts", f"expected an object mapping layer -> expert ids, got {raw!r}")
        experts: dict[int, tuple[int, ...]] = {}
        for key, ids in raw.items():
            if _is_int(key) or (isinstance(key, str) and key.isdigit()):
                layer = int(key)
            else:
                raise AdapterError("experts", f"layer key {key!r} is not a non-negative integer")
            if layer in experts:
                raise AdapterError("experts", f"layer {layer} is listed twice")
            if not isinstance(ids, list) or any(not _is_int(e) for e in ids):
                raise AdapterError("experts", f"layer {layer}: expected a list of integer expert ids, got {ids!r}")
            if ids:
                experts[layer] = tuple(dict.fromkeys(ids))  # dedupe, keep file order
        for field in ("shared_experts", "non_expert_modules"):
            if not isinstance(obj.get(field, False), bool):
                raise AdapterError(field, f"expected a boolean, got {obj[field]!r}")
        return cls(
            experts=dict(sorted(experts.items())),
            shared_experts=obj.get("shared_experts", False),
            non_expert_modules=obj.get("non_expert_modules", False),
        )

    @classmethod
    def from_file(cls, path: str | os.PathLike) -> EsftConfig:
        try:
            obj = json.loads(Path(path).read_text())
        except OSError as exc:
            raise AdapterError("path", f"{path}: not readable") from exc
        except json.JSONDecodeError as exc:
            raise AdapterError("path", f"{path} is not valid JSON: {exc}") from exc
        return cls.from_json(obj)

    def to_json(self) -> dict[str, Any]:
        return {
            "experts": {str(layer): list(ids) for layer, ids in self.experts.items()},
            "shared_experts": self.shared_experts,
            "non_expert_modules": self.non_expert_modules,
        }

    @property
    def max_experts_per_layer(self) -> int:
        return max((len(ids) for ids in self.experts.values()), default=0)

    @property
    def num_experts_total(self) -> int:
        return sum(len(ids) for ids in self.experts.values())

    def check_supported(self) -> None:
        """Only routed experts are served: shared-expert or non-expert tuning is rejected."""
        tuned = [f for f in ("shared_experts", "non_expert_modules") if getattr(self, f)]
        if tuned:
            raise AdapterError("path", f"{' and '.join(tuned)} tuning is not supported: only routed experts are served")

    def check_fits(self, model: ModelConfig) -> None:
        """Every tuned layer is an MoE layer of `model` and every id one of its routed experts."""
        for layer, ids in self.experts.items():
            if layer >= model.num_layers or not model.is_moe_layer(layer):
                kind = "out of range" if layer >= model.num_layers else "a dense layer"
                raise AdapterError("experts", f"layer {layer} is {kind} of the base model "
                                   f"({model.num_layers} layers, MoE layers {list(model.moe_layer_ids)})")
            bad = [e for e in ids if e >= model.num_experts]
            if bad:
                raise AdapterError("experts", f"layer {layer}: expert ids {bad} outside [0, {model.num_experts})")

    def fitted_to(self, model: ModelConfig) -> EsftConfig:
        """A copy that fits `model`: non-MoE layers dropped, ids folded modulo num_experts and deduplicated."""
        experts = {
            layer: tuple(dict.fromkeys(e % model.num_experts for e in ids))
            for layer, ids in self.experts.items()
            if layer < model.num_layers and model.is_moe_layer(layer)
        }
        return EsftConfig(experts, self.shared_experts, self.non_expert_modules)


@dataclass(frozen=True, slots=True)
class ExpertTensors:
    """The checkpoint tensors of one routed expert, grouped as the engine stacks them.

    `w13` names are concatenated along dim 0 into one row `[2I, H]` of
    `layers.{l}.moe.w13`; `w2` names into one row `[H, I]` of `layers.{l}.moe.w2`.
    """

    w13: tuple[str, ...]
    w2: tuple[str, ...]
    w13_shape: tuple[int, ...]
    w2_shape: tuple[int, ...]

    def shapes(self) -> dict[str, tuple[int, ...]]:
        """Checkpoint name -> shape; each group splits its row evenly along dim 0."""
        out = {}
        for names, (rows, *rest) in ((self.w13, self.w13_shape), (self.w2, self.w2_shape)):
            for name in names:
                out[name] = (rows // len(names), *rest)
        return out


def expert_tensors(model: ModelConfig) -> dict[tuple[int, int], ExpertTensors]:
    """(layer, expert) -> its checkpoint tensors, for every routed expert of `model`."""
    from elasticmoe.models.registry import model_family

    specs = {s.name: s for s in model_family(model.arch).param_specs(model, tuple(range(model.num_experts)))}
    out = {}
    for layer in model.moe_layer_ids:
        w13, w2 = specs[f"layers.{layer}.moe.w13"], specs[f"layers.{layer}.moe.w2"]
        assert w13.expert_ids is not None and w2.expert_ids == w13.expert_ids
        for row, expert in enumerate(w13.expert_ids):
            out[layer, expert] = ExpertTensors(w13.sources[row], w2.sources[row], w13.shape[1:], w2.shape[1:])
    return out


class EsftAdapter:
    """A validated ESFT adapter directory; expert tensors are read lazily (mmap'd by safetensors)."""

    def __init__(self, name: str, path: Path, config: EsftConfig, tensors: dict[tuple[int, int], ExpertTensors],
                 file_of: dict[str, Path], stored_dtype: dict[str, torch.dtype], dtype: torch.dtype | None) -> None:
        self.name = name
        self.path = path
        self.config = config
        self.dtype = dtype  # None: the dtype stored in the adapter files
        self._tensors = tensors  # tuned (layer, expert) only
        self._file_of = file_of
        self._stored_dtype = stored_dtype
        self._handles: dict[Path, Any] = {}
        self._stored_name: dict[str, str] = {}  # full checkpoint name -> the name in the file, where they differ

    @classmethod
    def open(cls, name: str, path: str | os.PathLike, model_config: ModelConfig,
             dtype: torch.dtype | None = None) -> EsftAdapter:
        """Validate the adapter at `path` against the base model; raises `AdapterError`."""
        root = Path(path)
        # NOTE: one message whether the path is missing, a file, or a directory without the config:
        # an API caller learns nothing about which paths exist on the server.
        if not (root / EXPERT_CFG).is_file():
            raise AdapterError("path", f"{root}: no ESFT adapter here (want a directory with {EXPERT_CFG} "
                               "and *.safetensors)")
        config = EsftConfig.from_file(root / EXPERT_CFG)
        config.check_supported()
        config.check_fits(model_config)
        layout = expert_tensors(model_config)
        tuned = {(layer, e): layout[layer, e] for layer, ids in config.experts.items() for e in ids}

        file_of: dict[str, Path] = {}
        shape_of: dict[str, tuple[int, ...]] = {}
        dtype_of: dict[str, torch.dtype] = {}
        files = sorted(root.glob("*.safetensors"))
        if not files:
            raise AdapterError("path", f"{root} has no *.safetensors files")
        for file in files:
            try:
                with safe_open(str(file), framework="pt") as f:
                    for key in f.keys():
                        if key in file_of:
                            raise AdapterError("path", f"tensor {key!r} is in both {file_of[key].name} and {file.name}")
                        file_of[key] = file
                        info = f.get_slice(key)
                        shape_of[key] = tuple(info.get_shape())
                        if info.get_dtype() not in _ST_DTYPES:
                            raise AdapterError("path", f"tensor {key!r} has dtype {info.get_dtype()}, "
                                               f"expected one of {sorted(_ST_DTYPES)}")
                        dtype_of[key] = _ST_DTYPES[info.get_dtype()]
            except AdapterError:
                raise
            except Exception as exc:  # safetensors raises its own error types for corrupt files
                raise AdapterError("path", f"cannot read {file.name}: {exc}") from exc

        expected: dict[str, tuple[int, ...]] = {}
        for t in tuned.values():
            expected.update(t.shapes())
        # The ESFT repository's own loader names tensors relative to `model.model` ("layers...");
        # checkpoints name them in full ("model.layers..."). Either is accepted, not a mix.
        relative = {n.removeprefix(_INNER): n for n in expected if n.startswith(_INNER)}
        if not any(n in file_of for n in expected) and any(k in relative for k in file_of):
            renamed = {relative.get(k, k): k for k in file_of}
            file_of = {full: file_of[k] for full, k in renamed.items()}
            shape_of = {full: shape_of[k] for full, k in renamed.items()}
            dtype_of = {full: dtype_of[k] for full, k in renamed.items()}
            stored_name = {full: k for full, k in renamed.items() if full != k}
        else:
            stored_name = {}
        missing = [n for n in expected if n not in file_of]
        if missing:
            raise AdapterError("path", f"{len(missing)} tuned-expert tensors missing, e.g. {missing[0]!r}")
        wrong = [(n, shape_of[n], s) for n, s in expected.items() if shape_of[n] != s]
        if wrong:
            n, got, want = wrong[0]
            raise AdapterError("path", f"tensor {n!r} has shape {list(got)}, the base model's is {list(want)}")
        extra = sorted(set(file_of) - set(expected))
        if extra:
            raise AdapterError("path", f"{len(extra)} unexpected tensors (not a tuned expert in {EXPERT_CFG}), "
                               f"e.g. {extra[0]!r}")
        logger.info("adapter %s: %d experts over %d layers from %s", name, config.num_experts_total,
                    len(config.experts), root)
        adapter = cls(name, root, config, tuned, file_of, dtype_of, dtype)
        adapter._stored_name = stored_name
        return adapter

    def _read(self, name: str) -> torch.Tensor:
        file = self._file_of[name]
        handle = self._handles.get(file)
        if handle is None:
            handle = self._handles[file] = safe_open(str(file), framework="pt")
        return handle.get_tensor(self._stored_name.get(name, name))

    def expert_weights(self, layer: int, expert: int,
                       dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """One row of `layers.{layer}.moe.w13` [2I, H] (gate rows, then up rows) and of `.w2` [H, I]."""
        t = self._tensors.get((layer, expert))
        if t is None:
            raise KeyError(f"adapter {self.name}: expert {expert} of layer {layer} is not tuned")
        dtype = dtype or self.dtype
        w13 = torch.cat([self._read(n) for n in t.w13], dim=0)
        w2 = torch.cat([self._read(n) for n in t.w2], dim=0)
        return (w13, w2) if dtype is None else (w13.to(dtype), w2.to(dtype))

    def iter_tensors(self):
        """(checkpoint name, tensor as stored) for every tensor of the adapter."""
        for name in self._file_of:
            yield name, self._read(name)

    def nbytes(self, dtype: torch.dtype | None = None) -> int:
        """Bytes of all tuned experts (w13 + w2 rows) in `dtype` (default: the adapter's)."""
        dtype = dtype or self.dtype
        total = 0
        for t in self._tensors.values():
            for name, shape in t.shapes().items():
                total += torch.Size(shape).numel() * (dtype or self._stored_dtype[name]).itemsize
        return total

    def close(self) -> None:
        self._handles.clear()

    def __getstate__(self) -> dict[str, Any]:
        # Picklable (e.g. sent to a Ray actor): file handles are reopened lazily on the other side.
        return {**self.__dict__, "_handles": {}}

    def __repr__(self) -> str:
        return f"EsftAdapter({self.name!r}, {str(self.path)!r}, {self.config.num_experts_total} experts)"
