"""`RankStats`: what a rank reports of itself and its engine to the coordinator (routing, healing,
metrics), one frozen snapshot per poll; `rank_stats` makes it from the backend's counters."""

from __future__ import annotations

import dataclasses

from imm.engine_backend import EngineCounters


@dataclasses.dataclass(frozen=True, slots=True)
class RankStats:
    rank: int
    num_running: int
    num_waiting: int
    num_kv_blocks: int
    num_free_kv_blocks: int
    num_steps: int
    # Identifies the engine these counters come from (one per rank process): under one
    # `engine_id` the `num_lora_*` counters only grow, so the coordinator can sum them
    # across instances (`coordinator.metrics`).
    engine_id: str = ""
    num_lora_slots: int = 0  # LoRA slots of this rank (0: LoRA off)
    lora_slot_bytes: int = 0  # what one of them takes: the rank's own memory, outside the HMM's budget
    num_lora_resident: int = 0  # LoRA adapters in a slot
    num_lora_swaps_in: int = 0  # LoRA adapters copied into a slot (host -> slot)
    num_lora_preloads: int = 0  # ... of them ahead of any request (by usage probability)
    num_lora_evictions: int = 0
    num_lora_hits: int = 0  # requests admitted with their LoRA adapter in a slot
    num_lora_misses: int = 0  # requests that had to wait for a swap-in
    lora_swap_us: int = 0  # time spent copying LoRA factors into slots
    arrange_us: int = 0  # time the scheduler spent arranging its window
    # Expert offloading (0 everywhere: off): the cache's rows, and counters that only grow per engine.
    expert_cache_capacity: int = 0
    expert_cache_resident: int = 0
    num_expert_lookups: int = 0
    num_expert_hits: int = 0
    num_expert_loads_on_demand: int = 0
    num_expert_loads_prefetch: int = 0
    expert_bytes_loaded_host: int = 0
    expert_bytes_loaded_disk: int = 0
    num_prefix_cache_queries: int = 0  # prompt tokens looked up in the prefix cache
    num_prefix_cache_hits: int = 0  # ... found there (not computed again)

    @property
    def kv_usage(self) -> float:
        return 1.0 - self.num_free_kv_blocks / self.num_kv_blocks if self.num_kv_blocks else 0.0

    @property
    def load(self) -> tuple[int, float]:
        """Sort key for routing: requests first, KV usage as tie-break."""
        return (self.num_running + self.num_waiting, self.kv_usage)


def rank_stats(rank: int, engine_id: str, c: EngineCounters) -> RankStats:
    """The snapshot of rank `rank` (its engine `engine_id`) from its backend's counters."""
    return RankStats(
        rank=rank,
        num_running=c.num_running,
        num_waiting=c.num_waiting,
        num_kv_blocks=c.num_kv_blocks,
        num_free_kv_blocks=c.num_free_kv_blocks,
        num_steps=c.num_steps,
        engine_id=engine_id,
        num_lora_slots=c.lora.get("slots", 0),
        lora_slot_bytes=c.lora.get("slot_bytes", 0),
        num_lora_resident=c.lora.get("resident", 0),
        num_lora_swaps_in=c.lora.get("swaps_in", 0),
        num_lora_preloads=c.lora.get("preloads", 0),
        num_lora_evictions=c.lora.get("evictions", 0),
        num_lora_hits=c.lora.get("hits", 0),
        num_lora_misses=c.lora.get("misses", 0),
        lora_swap_us=c.lora.get("swap_us", 0),
        arrange_us=c.arrange_us,
        expert_cache_capacity=c.expert_cache.get("capacity_experts", 0),
        expert_cache_resident=c.expert_cache.get("resident_experts", 0),
        num_expert_lookups=c.expert_cache.get("lookups", 0),
        num_expert_hits=c.expert_cache.get("hits", 0),
        num_expert_loads_on_demand=c.expert_cache.get("on_demand_loads", 0),
        num_expert_loads_prefetch=c.expert_cache.get("prefetches", 0),
        expert_bytes_loaded_host=c.expert_cache.get("bytes_loaded_host", 0),
        expert_bytes_loaded_disk=c.expert_cache.get("bytes_loaded_disk", 0),
        num_prefix_cache_queries=c.num_prefix_cache_queries,
        num_prefix_cache_hits=c.num_prefix_cache_hits,
    )
