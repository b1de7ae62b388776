"""`HmmModelLoader`: a vLLM model loader whose weights are the HMM's device tensors.

Registered with vLLM's loader registry as load format `elasticmoe_hmm`. vLLM builds the model and
calls `load_weights`; the weights come from a rank's HMM handle set (shared memory), never from
disk:

1. each HMM tensor is matched with the vLLM parameter it *is*: the same checkpoint tensors in the
   same order, the same shape and dtype (the HMM's `layers.i.attn.qkv` is vLLM's `qkv_proj`, its
   stacked `layers.i.moe.w13` [E, 2I, H] is vLLM's `w13_weight`, ...). Such a parameter is bound to
   the mapped tensor in place (`param.data = tensor`): zero-copy;
2. whatever does not match is streamed, as checkpoint-named views of the HMM tensors, through vLLM's
   own `model.load_weights`, which copies it into vLLM's parameter; a parameter neither bound nor
   loaded is an error (it would hold garbage);
3. vLLM then post-processes the weights as it does for any loader. Its CPU backend repacks what its
   kernels read into new, private tensors (oneDNN / sgl packed linear weights, the MoE experts'
   grouped-GEMM layout): those are copies, whatever the loader did.

`WeightReport` says, per tensor kind, how many bytes vLLM still reads from the HMM's memory and how
many it holds in private copies, measured after step 3. `rebind` moves the mapped parameters of a
built engine to another handle set with the same bytes (a standby engine built on a replica,
attached to its own device; see `imm.vllm_backend`).

How the loader finds the weights: vLLM constructs loaders itself, from its `LoadConfig`. The vLLM
engine runs in the rank's process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`, single-process executor), so
the backend `stage`s the weights under a key that it passes in `model_loader_extra_config`.
NOTE: import this module only where vLLM is installed (the `vllm` extra).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from vllm.model_executor.model_loader import register_model_loader
from vllm.model_executor.model_loader.base_loader import BaseModelLoader

from elasticmoe.models.weights import ParamSpec
from hmm.layout import KV_POOL
from hmm.providers import Handle, open_handle

logger = logging.getLogger(__name__)

LOAD_FORMAT = "elasticmoe_hmm"
KEY = "elasticmoe_key"  # the `model_loader_extra_config` entry naming the staged weights


@dataclass(frozen=True, slots=True)
class Binding:
    """vLLM parameter `param` *is* HMM tensor `tensor` (its first `rows` rows when stacked)."""

    param: str
    tensor: str
    rows: int | None


@dataclass(slots=True)
class KindBytes:
    mapped: int = 0  # vLLM reads the HMM's tensor in place
    copied: int = 0  # vLLM holds a private copy (streamed into its parameter, or repacked)


@dataclass(frozen=True, slots=True)
class WeightReport:
    """Where a vLLM engine's weights live after loading (or after `rebind`).

    `as_given`: parameters bound in place that vLLM still reads as given; `num_mapped` of them are
    (after a rebind: must be all). `kinds`: tensor kind -> bytes mapped / copied.
    `rss_anon_delta`: the process's private resident memory growth over vLLM's post-processing
    (a cross-check of the copies; 0 after a rebind)."""

    num_as_given: int
    num_mapped: int
    kinds: dict[str, KindBytes]
    rss_anon_delta: int
    attach_s: float = 0.0

    @property
    def bytes_mapped(self) -> int:
        return sum(k.mapped for k in self.kinds.values())

    @property
    def bytes_copied(self) -> int:
        return sum(k.copied for k in self.kinds.values())

    @property
    def is_zero_copy(self) -> bool:
        """Every tensor vLLM uses as given is the HMM's memory (its repacks are copies by design)."""
        return self.num_mapped == self.num_as_given

    def as_dict(self) -> dict[str, Any]:
        return {"bytes_mapped": self.bytes_mapped, "bytes_copied": self.bytes_copied,
                "rss_anon_delta": self.rss_anon_delta, "attach_s": self.attach_s,
                "kinds": {k: dataclasses.asdict(v) for k, v in sorted(self.kinds.items())}}


@dataclass(slots=True)
class StagedWeights:
    """One engine's weights: handle set, the specs that say what each tensor is made of, and the
    checkpoint tensors' row counts (to cut views for the copy path). The loader fills in the rest."""

    handles: Mapping[str, Handle]
    specs: Mapping[str, ParamSpec]
    rows_of: Mapping[str, int]  # checkpoint tensor name -> its dim-0 size
    bindings: list[Binding] = field(default_factory=list)
    opened: dict[str, torch.Tensor] = field(default_factory=dict)
    report: WeightReport | None = None


_STAGED: dict[str, StagedWeights] = {}


def stage(key: str, weights: StagedWeights) -> None:
    """Make `weights` findable by the loader of an engine built in this process whose load config
    names `key` (`model_loader_extra_config={KEY: key}`)."""
    _STAGED[key] = weights


def unstage(key: str) -> StagedWeights | None:
    return _STAGED.pop(key, None)


def tensor_kind(name: str) -> str:
    """The kind of an HMM (engine) tensor name, as the docs report them."""
    leaf = name.rsplit(".", 1)[-1]
    if name in ("embed", "lm_head"):
        return name
    if "norm" in leaf:
        return "norms"
    if ".attn." in name:
        return "attention"
    if name.endswith("moe.router"):
        return "router"
    if ".moe." in name:
        return "experts"
    return "dense_mlp"


# ---- step 1: which vLLM parameter is which HMM tensor -------------------------------------


def _vllm_param_for(spec: ParamSpec, model: nn.Module, params: Mapping[str, nn.Parameter]) -> str | None:
    """The vLLM parameter made of exactly `spec`'s checkpoint tensors, in the same order, if any."""
    if spec.is_stacked:  # rows of `<module>.experts.<e>.<proj>.weight`: FusedMoE's w13 ([w1; w3]) or w2
        row = spec.sources[0]
        module = row[0].rsplit(".", 3)[0]  # model.layers.0.mlp.experts
        leaf = {2: ".w13_weight", 1: ".w2_weight"}.get(len(row))
        found = [p for p in params if leaf and p.startswith(module + ".") and p.endswith(leaf)]
        return found[0] if len(found) == 1 else None
    sources = spec.sources[0]
    if len(sources) == 1:
        return sources[0] if sources[0] in params else None
    module = sources[0].rsplit(".", 2)[0]
    leaves = [s.rsplit(".", 2)[1] for s in sources]
    if any(s.rsplit(".", 2)[0] != module for s in sources):
        return None
    packed = dict(getattr(model, "packed_modules_mapping", {}) or {})
    packed.setdefault("gate_up_proj", ["gate_proj", "up_proj"])  # merged dense MLPs, by vLLM's naming
    found = [f"{module}.{name}.weight" for name, parts in packed.items() if list(parts) == leaves]
    found = [p for p in found if p in params]
    return found[0] if len(found) == 1 else None


def _checkpoint_views(staged: StagedWeights, name: str, tensor: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
    """HMM tensor `name` cut back into its checkpoint tensors (views, no copy)."""
    spec = staged.specs[name]
    rows = zip(tensor, spec.sources, strict=False) if spec.is_stacked else [(tensor, spec.sources[0])]
    for dst, sources in rows:
        offset = 0
        for source in sources:
            n = staged.rows_of[source]
            yield source, dst[offset : offset + n]
            offset += n


def bind(model: nn.Module, staged: StagedWeights) -> None:
    """Steps 1 and 2 (see the module docstring): bind what matches, stream the rest to vLLM."""
    params = dict(model.named_parameters())
    bound: set[str] = set()
    streamed: list[tuple[str, torch.Tensor]] = []
    for name, handle in staged.handles.items():
        if name == KV_POOL or name not in staged.specs:
            continue
        spec = staged.specs[name]
        tensor = open_handle(handle)
        rows = len(spec.expert_ids) if spec.expert_ids is not None else None
        if rows is not None:
            tensor = tensor[:rows]  # ESFT adapter rows past the experts are not vLLM's
        staged.opened[name] = tensor
        target = _vllm_param_for(spec, model, params)
        param = params.get(target) if target is not None and target not in bound else None
        if param is not None and param.shape == tensor.shape and param.dtype == tensor.dtype:
            param.data = tensor
            bound.add(str(target))
            staged.bindings.append(Binding(str(target), name, rows))
        else:
            streamed.extend(_checkpoint_views(staged, name, tensor))
    loaded = set(model.load_weights(iter(streamed))) if streamed else set()  # type: ignore[operator]
    missing = sorted(set(params) - bound - loaded)
    if missing:
        raise RuntimeError(f"vLLM parameters without an HMM tensor: {missing[:8]}")
    logger.info("hmm loader: %d parameters bound in place, %d checkpoint tensors copied in", len(bound), len(streamed))


# ---- step 3 and after: what is still mapped -----------------------------------------------


def _rss_anon() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    return 0


def _has_packed_kernel(module: nn.Module) -> bool:
    """vLLM's CPU linear dispatch keeps a packed copy of the weight in its kernel's closure (oneDNN
    handle, sgl packed weight); its plain fallback closes over nothing and reads the parameter."""
    fn = getattr(module, "cpu_linear", None)
    code = getattr(fn, "__code__", None)
    return bool(code is not None and code.co_freevars)


def measure(model: nn.Module, staged: StagedWeights, rss_anon_delta: int, attach_s: float = 0.0) -> WeightReport:
    """Per kind, the bytes vLLM reads from the HMM's tensors and those it holds privately."""
    kinds: dict[str, KindBytes] = {}
    bound = {b.tensor for b in staged.bindings}
    num_as_given = num_mapped = 0
    for b in staged.bindings:
        tensor = staged.opened[b.tensor]
        nbytes = tensor.numel() * tensor.element_size()
        kind = kinds.setdefault(tensor_kind(b.tensor), KindBytes())
        module = model.get_submodule(b.param.rpartition(".")[0])
        param = model.get_parameter(b.param)
        if param.numel() and param.data_ptr() == tensor.data_ptr():
            num_as_given += 1
            num_mapped += 1
            kind.mapped += nbytes
            if _has_packed_kernel(module):
                kind.copied += nbytes  # read in place (e.g. embedding lookups) and packed for matmuls
        else:
            kind.copied += nbytes  # repacked into a new tensor
    for name, tensor in staged.opened.items():
        if name not in bound:  # streamed through vLLM's weight loaders
            kinds.setdefault(tensor_kind(name), KindBytes()).copied += tensor.numel() * tensor.element_size()
    return WeightReport(num_as_given, num_mapped, kinds, rss_anon_delta, attach_s)


def rebind(model: nn.Module, staged: StagedWeights, handles: Mapping[str, Handle]) -> StagedWeights:
    """Point every parameter still mapped from `staged`'s tensors at the same tensor of `handles`
    (the same bytes on another device: a replica); returns the new staging, with `opened` and
    `bindings` of `handles`. Raises if a tensor's shape, dtype or content differs (not a replica)."""
    moved = StagedWeights(handles, staged.specs, staged.rows_of)
    for b in staged.bindings:
        old = staged.opened[b.tensor]
        param = model.get_parameter(b.param)
        new = open_handle(handles[b.tensor])
        if b.rows is not None:
            new = new[: b.rows]
        moved.opened[b.tensor] = new
        if not (param.numel() and param.data_ptr() == old.data_ptr()):
            continue  # vLLM repacked it: its private copy already holds these bytes
        if new.shape != old.shape or new.dtype != old.dtype or not torch.equal(new, old):
            raise RuntimeError(f"rebind: {b.tensor} differs from the tensor the engine was built on")
        param.data = new
        moved.bindings.append(b)
    for name in staged.opened:
        if name not in moved.opened:
            tensor = open_handle(handles[name])
            spec = staged.specs[name]
            moved.opened[name] = tensor[: len(spec.expert_ids)] if spec.expert_ids is not None else tensor
    return moved


@register_model_loader(LOAD_FORMAT)
class HmmModelLoader(BaseModelLoader):
    """vLLM loader over staged HMM handles (see the module docstring)."""

    def _staged(self) -> StagedWeights:
        extra = self.load_config.model_loader_extra_config or {}
        key = extra.get(KEY) if isinstance(extra, dict) else None
        staged = _STAGED.get(str(key))
        if staged is None:
            raise RuntimeError(f"{LOAD_FORMAT}: no HMM weights staged in this process under {key!r} (the vLLM "
                               "engine must run in the rank's process: VLLM_ENABLE_V1_MULTIPROCESSING=0)")
        return staged

    def download_model(self, model_config: Any) -> None:
        pass  # nothing on disk: the weights are in the HMM's memory

    def load_weights(self, model: nn.Module, model_config: Any) -> None:
        bind(model, self._staged())

    def load_model(self, vllm_config: Any, model_config: Any, prefix: str = "") -> nn.Module:
        staged = self._staged()
        rss = _rss_anon()
        model = super().load_model(vllm_config=vllm_config, model_config=model_config, prefix=prefix)
        staged.report = measure(model, staged, _rss_anon() - rss)
        return model
