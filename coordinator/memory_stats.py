"""What the HMM's memory holds, as the coordinator reports it (`/metrics`, `/admin/status`):
per device the accounting and the committed layout's bytes by kind, and the adapter slots in
use. Pure: `ClusterManager.device_memory` / `adapter_slots` fill these from the cluster."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from hmm.controller import EsftEntry
from hmm.layout import Layout
from hmm.memory.segments import round_up

# host_experts: the host tier of an offloading layout (held by the device's worker, not charged
# to its budget); the others are charged to the device.
MEMORY_KINDS = ("weights", "kv", "adapters", "expert_cache", "host_experts")


@dataclass(frozen=True, slots=True)
class DeviceMemoryStats:
    """One device's HMM memory: the accounting (every byte charged, so `used_bytes` includes
    what a running scale has staged; `peak_bytes` since the last scale started) and the
    committed layout's share of it by kind (`MEMORY_KINDS`; empty when the device holds none)."""

    device_id: int
    capacity_bytes: int
    used_bytes: int
    peak_bytes: int
    layout_bytes: dict[str, int]


@dataclass(frozen=True, slots=True)
class AdapterSlotStats:
    """Adapters registered of one kind and the slots for them (ESFT: cluster-wide; LoRA: per rank,
    the same on every rank). Unloading adapters still hold their slot."""

    kind: str  # "esft" | "lora"
    num_loaded: int
    num_slots: int


def layout_memory(layout: Layout, adapters: Iterable[EsftEntry], page_size: int) -> dict[int, dict[str, int]]:
    """device -> kind -> bytes `layout` and the ESFT `adapters` hold there, rounded as the HMM
    charges them (dense tensors and pools to OS pages, expert rows to `page_size` pages). With
    offloading the expert rows are `host_experts` (0 with the disk tier) and the device holds an
    `expert_cache`."""
    sizes = layout.sizes
    dense = sum(round_up(b) for _, b in sizes.dense)
    expert = sum(round_up(b, page_size) for _, _, b in sizes.expert_stacks)
    out: dict[int, dict[str, int]] = {}
    for d, kv in zip(layout.device_ids, layout.kv_bytes, strict=True):
        experts = len(layout.local_experts(d)) * expert
        out[d] = {"weights": dense + (0 if layout.offloads else experts), "kv": round_up(kv), "adapters": 0}
        if layout.offloads:  # the disk tier holds no expert row anywhere
            out[d].update(expert_cache=round_up(layout.cache_bytes_of(d)),
                          host_experts=experts if layout.host_experts else 0)
    for entry in adapters:  # an adapter expert lives on the device of the base expert it replaces
        for layer, expert_ids in entry.experts.items():
            row = sum(round_up(b, page_size) for _, at, b in sizes.expert_stacks if at == layer)
            for e in expert_ids:
                out[layout.holder(e)]["adapters"] += row
    return out
