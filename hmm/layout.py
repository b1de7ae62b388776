"""What lives on which device for one (dp, ep) configuration.

A `Layout` is derived, never edited: from the model's tensor sizes, the devices
(rank `r` runs on `devices[r]`), the expert placement and the KV pool size per
device. Invariants, checked in `__post_init__`:

- every non-expert ("dense") tensor is replicated on every device (tp = 1);
- expert parallel (ep = dp, the native engine): every expert lives on exactly one device,
  `devices[placement.expert_to_rank[e]]`, at local slot `placement.expert_to_slot[e]` of each
  of that device's virtual expert tensors (one per stacked engine tensor, e.g. `layers.3.moe.w13`);
- replicated experts (ep = 1, a placement over one rank; data-parallel replicas that run no EP
  group, e.g. the vLLM backend): every device holds every expert, at the slots of that one rank,
  so an expert is copied like a dense tensor (every device is a holder);
- one KV pool per device, and weights + KV pool fit in the device's budget;
- expert offloading (`cache_bytes` set, FineMoE's tiers): every device also has an expert cache
  pool (rows the engine copies experts into), and its expert rows are the *host tier*: still held
  by the device's worker (one copy per node under expert parallelism) but charged to host memory,
  not to the device's budget. Then dense + KV pool + expert cache fit the budget, however many
  experts the device holds: a scale-down to fewer devices offloads instead of being refused.
  With the disk tier (`host_experts=False`, for experts larger than the node's memory) the expert
  rows are held nowhere: the engines read them from the checkpoint, so the layout lists no expert
  tensors and a scale moves none. The stacks are still virtual tensors in host memory with no
  expert row mapped: ESFT adapter rows, past the experts, are mapped there as with the host tier.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from elasticmoe.parallel.expert_placement import ExpertPlacement

if TYPE_CHECKING:
    from elasticmoe.config import ModelConfig
    from elasticmoe.models.weights import ParamSpec

TensorKind = Literal["dense", "expert", "kv", "cache"]
KV_POOL = "kv_pool"
EXPERT_CACHE = "expert_cache"
_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


@dataclass(frozen=True, slots=True)
class DeviceSpec:
    """A logical accelerator: id, the node it sits on, and its memory budget.

    `ray_node_id`: the Ray node whose `elasticmoe_device` resource it is; its worker, and the
    rank using it, run there (zero-copy needs one host). None: wherever Ray puts them (a
    single-host cluster, tests)."""

    device_id: int
    node_id: int
    budget_bytes: int
    ray_node_id: str | None = None

    def __post_init__(self) -> None:
        if self.device_id < 0 or self.node_id < 0:
            raise ValueError(f"device: ids must be >= 0, got device {self.device_id} node {self.node_id}")
        if self.budget_bytes <= 0:
            raise ValueError(f"device {self.device_id}: budget_bytes must be > 0, got {self.budget_bytes}")


@dataclass(frozen=True, slots=True)
class TensorKey:
    """Names one tensor the HMM holds on a device, independent of where it is.

    dense: an engine tensor (`name`), same bytes on every replica. expert: row
    `expert` of the stacked engine tensor `name` of MoE `layer`. kv: the device's
    KV pool (`name == "kv_pool"`), reused in place by the next layout. cache: the device's expert
    cache pool (`name == "expert_cache"`), private to one instance: every layout gets a new one.
    Pools (kv, cache) start empty and are never copied.
    """

    kind: TensorKind
    name: str
    layer: int | None = None
    expert: int | None = None

    def __post_init__(self) -> None:
        if self.kind not in ("dense", "expert", "kv", "cache"):
            raise ValueError(f"tensor key: unknown kind {self.kind!r}")
        if (self.kind == "expert") != (self.expert is not None and self.layer is not None):
            raise ValueError(f"tensor key {self.name!r}: layer and expert are set exactly for expert keys")
        if self.kind == "kv" and self.name != KV_POOL:
            raise ValueError(f"tensor key: a kv key is named {KV_POOL!r}, got {self.name!r}")
        if self.kind == "cache" and self.name != EXPERT_CACHE:
            raise ValueError(f"tensor key: a cache key is named {EXPERT_CACHE!r}, got {self.name!r}")

    @property
    def is_pool(self) -> bool:
        """A pool (KV or expert cache): allocated empty, never filled or copied by a plan."""
        return self.kind in ("kv", "cache")

    @property
    def expert_id(self) -> int:
        """The expert of an expert key (ValueError for other kinds)."""
        if self.expert is None:
            raise ValueError(f"tensor key {self.name!r} is not an expert row")
        return self.expert

    @classmethod
    def dense(cls, name: str) -> TensorKey:
        m = _LAYER.search(name)
        return cls("dense", name, int(m.group(1)) if m else None)

    @classmethod
    def expert_row(cls, name: str, layer: int, expert: int) -> TensorKey:
        return cls("expert", name, layer, expert)

    @classmethod
    def kv(cls) -> TensorKey:
        return cls("kv", KV_POOL)

    @classmethod
    def cache(cls) -> TensorKey:
        return cls("cache", EXPERT_CACHE)


@dataclass(frozen=True, slots=True)
class ModelSizes:
    """Byte sizes of a model's tensors: `dense` (name, bytes) and
    `expert_stacks` (stacked tensor name, layer, bytes of one expert row)."""

    num_experts: int
    dense: tuple[tuple[str, int], ...]
    expert_stacks: tuple[tuple[str, int, int], ...]

    def __post_init__(self) -> None:
        if self.num_experts < 1:
            raise ValueError(f"model sizes: num_experts must be >= 1, got {self.num_experts}")
        names = [n for n, _ in self.dense] + [n for n, _, _ in self.expert_stacks]
        if len(set(names)) != len(names):
            raise ValueError("model sizes: tensor names must be unique")
        if any(b < 0 for _, b in self.dense) or any(b < 0 for _, _, b in self.expert_stacks):
            raise ValueError("model sizes: byte sizes must be >= 0")

    @classmethod
    def from_specs(cls, specs: Sequence[ParamSpec], num_experts: int, dtype_bytes: int) -> ModelSizes:
        """Sizes from the engine's `ParamSpec`s (any local expert subset: rows are equal)."""
        dense, stacks = [], []
        for spec in specs:
            if spec.is_stacked:
                m = _LAYER.search(spec.name)
                if m is None:
                    raise ValueError(f"{spec.name}: a stacked expert tensor must be named layers.<i>.*")
                stacks.append((spec.name, int(m.group(1)), math.prod(spec.shape[1:]) * dtype_bytes))
            else:
                dense.append((spec.name, math.prod(spec.shape) * dtype_bytes))
        return cls(num_experts, tuple(dense), tuple(stacks))

    @classmethod
    def from_model(cls, cfg: ModelConfig, dtype_bytes: int) -> ModelSizes:
        from elasticmoe.models.registry import model_family

        specs = model_family(cfg.arch).param_specs(cfg, tuple(range(cfg.num_experts)))
        return cls.from_specs(specs, cfg.num_experts, dtype_bytes)

    @property
    def dense_bytes(self) -> int:
        return sum(b for _, b in self.dense)

    @property
    def expert_bytes(self) -> int:
        """Bytes of one expert across all MoE layers and stacked tensors."""
        return sum(b for _, _, b in self.expert_stacks)

    @property
    def cache_row_bytes(self) -> int:
        """Bytes of one row of an expert cache: one expert of one MoE layer (all its stacks)."""
        per_layer: dict[int, int] = {}
        for _, layer, b in self.expert_stacks:
            per_layer[layer] = per_layer.get(layer, 0) + b
        return max(per_layer.values(), default=0)

    @property
    def num_moe_layers(self) -> int:
        return len({layer for _, layer, _ in self.expert_stacks})

    def cache_pool_bytes(self, experts_per_device: int, budget_bytes: int | None = None,
                         fraction: float | None = None) -> int:
        """An expert cache pool of whole rows: `budget_bytes` of it, or `fraction` of a device
        holding `experts_per_device` experts (all MoE layers), rounded up."""
        if (budget_bytes is None) == (fraction is None):
            raise ValueError("expert cache: give a byte budget or a fraction, exactly one")
        if budget_bytes is not None:
            rows = budget_bytes // self.cache_row_bytes
        else:
            assert fraction is not None
            rows = math.ceil(fraction * self.num_moe_layers * experts_per_device)
        return rows * self.cache_row_bytes

    def weight_bytes(self, num_local_experts: int) -> int:
        return self.dense_bytes + num_local_experts * self.expert_bytes

    def expert_keys(self, expert: int) -> dict[TensorKey, int]:
        return {TensorKey.expert_row(n, layer, expert): b for n, layer, b in self.expert_stacks}


@dataclass(frozen=True, slots=True)
class Layout:
    """Tensors per device for dp = len(devices) and ep = dp or 1 (see the module docstring)."""

    sizes: ModelSizes
    devices: tuple[DeviceSpec, ...]
    placement: ExpertPlacement
    kv_bytes: tuple[int, ...]  # KV pool bytes of devices[r]
    cache_bytes: tuple[int, ...] = ()  # expert cache pool bytes of devices[r]; () = no offloading
    host_experts: bool = True  # offloading: the expert rows are the host tier (False: the disk tier)

    def __post_init__(self) -> None:
        ids = [d.device_id for d in self.devices]
        if not ids or len(set(ids)) != len(ids):
            raise ValueError(f"layout: device ids must be distinct and non-empty, got {ids}")
        if (
            self.placement.num_ranks not in (1, len(self.devices))
            or self.placement.num_experts != self.sizes.num_experts
        ):
            raise ValueError(
                f"layout: placement is {self.placement.num_experts} experts on {self.placement.num_ranks} ranks, "
                f"expected {self.sizes.num_experts} on {len(self.devices)} (expert parallel) or on 1 (replicated)"
            )
        if len(self.kv_bytes) != len(self.devices) or any(b < 0 for b in self.kv_bytes):
            raise ValueError("layout: one KV pool size >= 0 per device")
        if self.cache_bytes and (len(self.cache_bytes) != len(self.devices) or min(self.cache_bytes) <= 0):
            raise ValueError("layout: with offloading, one expert cache size > 0 per device")
        if not self.host_experts and not self.offloads:
            raise ValueError("layout: the disk tier (host_experts=False) needs offloading (cache_bytes)")
        for rank, dev in enumerate(self.devices):
            if self.total_bytes(dev.device_id) > dev.budget_bytes:
                held = (f"dense weights {self.sizes.dense_bytes} B + expert cache {self.cache_bytes[rank]} B"
                        if self.offloads else f"weights {self.weight_bytes(dev.device_id)} B")
                raise ValueError(
                    f"device {dev.device_id}: {held} + KV pool {self.kv_bytes[rank]} B exceed its budget "
                    f"{dev.budget_bytes} B"
                )

    @property
    def dp(self) -> int:
        return len(self.devices)

    @property
    def ep(self) -> int:
        return self.placement.num_ranks

    @property
    def offloads(self) -> bool:
        """Experts are offloaded: the devices hold an expert cache, the expert rows are host tier
        (or, without `host_experts`, only in the checkpoint)."""
        return bool(self.cache_bytes)

    @property
    def is_replicated(self) -> bool:
        """Every device holds every expert (ep = 1; with dp = 1 both readings agree)."""
        return self.placement.num_ranks == 1

    @property
    def device_ids(self) -> tuple[int, ...]:
        return tuple(d.device_id for d in self.devices)

    def rank_of(self, device_id: int) -> int:
        return self.device_ids.index(device_id)

    def device(self, device_id: int) -> DeviceSpec:
        return self.devices[self.rank_of(device_id)]

    def holder(self, expert: int) -> int:
        """Device id holding `expert` (replicated: the first of its holders)."""
        return self.devices[self.placement.expert_to_rank[expert]].device_id

    def holders(self, expert: int) -> tuple[int, ...]:
        """Every device holding `expert`: one with expert parallelism, all when replicated."""
        return self.device_ids if self.is_replicated else (self.holder(expert),)

    def slot(self, expert: int) -> int:
        return self.placement.expert_to_slot[expert]

    def local_experts(self, device_id: int) -> tuple[int, ...]:
        return self.placement.local_expert_ids(0 if self.is_replicated else self.rank_of(device_id))

    def tensors(self, device_id: int) -> dict[TensorKey, int]:
        """key -> bytes of every tensor on `device_id` (empty if not in the layout)."""
        if device_id not in self.device_ids:
            return {}
        out = {TensorKey.dense(n): b for n, b in self.sizes.dense}
        for e in self.local_experts(device_id) if self.host_experts else ():
            out.update(self.sizes.expert_keys(e))
        out[TensorKey.kv()] = self.kv_bytes[self.rank_of(device_id)]
        if self.offloads:
            out[TensorKey.cache()] = self.cache_bytes[self.rank_of(device_id)]
        return out

    def cache_bytes_of(self, device_id: int) -> int:
        """The device's expert cache pool (0 without offloading or outside the layout)."""
        if not self.offloads or device_id not in self.device_ids:
            return 0
        return self.cache_bytes[self.rank_of(device_id)]

    def charged(self, key: TensorKey) -> bool:
        """Whether `key` counts against its device's budget (host-tier expert rows do not)."""
        return not (self.offloads and key.kind == "expert")

    def weight_bytes(self, device_id: int) -> int:
        return self.sizes.weight_bytes(len(self.local_experts(device_id)))

    def total_bytes(self, device_id: int) -> int:
        """Bytes charged to the device's budget: everything it holds but host-tier experts."""
        if device_id not in self.device_ids:
            return 0
        return sum(b for k, b in self.tensors(device_id).items() if self.charged(k))

    def host_bytes(self, device_id: int) -> int:
        """Bytes of the device's expert rows held as the host tier (0 without offloading, or with the
        disk tier)."""
        if not self.offloads or not self.host_experts or device_id not in self.device_ids:
            return 0
        return len(self.local_experts(device_id)) * self.sizes.expert_bytes


def layout_for(
    model_cfg: ModelConfig | None,
    weights: Sequence[ParamSpec] | ModelSizes,
    devices: Sequence[DeviceSpec],
    dp: int,
    ep: int,
    placement: ExpertPlacement | None = None,
    *,
    kv_bytes: int | None = None,
    cache_bytes: int | None = None,
    host_experts: bool = True,
    dtype_bytes: int = 2,
) -> Layout:
    """The layout of (dp, ep) on `devices[:dp]`; ep = dp (expert parallel) or 1 (replicated experts).

    `weights` are the engine's ParamSpecs (then `model_cfg` gives num_experts and
    `dtype_bytes` the element size) or precomputed `ModelSizes`. `placement`
    defaults to `ExpertPlacement.balanced` over the ep ranks. `kv_bytes=None` gives each device a
    KV pool of its budget minus its weights; an int is the pool size everywhere. `cache_bytes`
    offloads the experts: each device gets an expert cache of that size and its expert rows are
    the host tier, or with `host_experts=False` held nowhere (the disk tier; the module docstring).
    Raises ValueError when the weights (plus a fixed KV pool) do not fit.
    """
    if ep not in (1, dp):
        raise ValueError(f"layout: ep must be dp (expert parallel) or 1 (replicated experts), got dp={dp} ep={ep}")
    if len(devices) < dp:
        raise ValueError(f"layout: dp={dp} needs {dp} devices, got {len(devices)}")
    if isinstance(weights, ModelSizes):
        sizes = weights
    else:
        if model_cfg is None:
            raise ValueError("layout: model_cfg is required with ParamSpecs")
        sizes = ModelSizes.from_specs(weights, model_cfg.num_experts, dtype_bytes)
    if placement is None:
        placement = ExpertPlacement.balanced(sizes.num_experts, ep)
    used = tuple(devices[:dp])
    kv = []
    for rank, dev in enumerate(used):
        if cache_bytes is not None:
            weight = sizes.dense_bytes + cache_bytes
            what = "dense weights + expert cache"
        else:
            weight = sizes.weight_bytes(len(placement.local_expert_ids(rank if ep == dp else 0)))
            what = "weights"
        if weight > dev.budget_bytes:
            raise ValueError(f"device {dev.device_id}: {what} {weight} B exceed its budget {dev.budget_bytes} B")
        kv.append(dev.budget_bytes - weight if kv_bytes is None else kv_bytes)
    cache = () if cache_bytes is None else (cache_bytes,) * dp
    return Layout(sizes, used, placement, tuple(kv), cache, host_experts)
