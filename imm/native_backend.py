"""`NativeBackend`: ElasticMoE's own engine behind `EngineBackend` (the default backend).

- standby: the engine config (this rank's expert-parallel slot) and the tokenizer; no weights;
- attach: an `LLMEngine` on HMM handles (`ZeroCopyLoader`: weights used in place, the KV pool is
  the device's), fenced when a serving rank still allocates from that pool (`KVFence`);
- the lockstep loop steps it over the instance's gloo group (expert parallelism);
- handover keeps KV: on a kept device the block tables travel with the snapshots;
- ESFT and LoRA adapters live here (the coordinator drives every rank, `coordinator.adapters`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from elasticmoe.adapters.lora import LoraAdapter
from elasticmoe.config import EngineConfig, EngineOptions, ModelConfig
from elasticmoe.engine.engine_request import EngineRequest
from elasticmoe.engine.handover import RequestSnapshot
from elasticmoe.engine.llm_engine import LLMEngine
from elasticmoe.parallel.expert_placement import ExpertPlacement
from elasticmoe.tokenizer import Tokenizer
from elasticmoe.utils.passing_thread import in_passing_thread
from hmm.memory import VirtualTensorHandle, map_slot_pages, unmap_slot_pages
from hmm.memory.page_table import SlotPages
from hmm.providers import Handle
from imm.engine_backend import BackendName, EngineCounters
from imm.handover import KVFence
from imm.loop_backend import LoopBackend
from imm.zero_copy import AttachReport, ZeroCopyLoader, check_zero_copy


class NativeBackend(LoopBackend):
    """`LLMEngine` stepped in lockstep with the other ranks of its expert-parallel group."""

    name: BackendName = "native"
    uses_ep_group = True

    def __init__(self) -> None:
        super().__init__()
        self.config: EngineConfig | None = None
        self.tokenizer: Tokenizer | None = None
        self.engine: LLMEngine | None = None
        self.kv_fence: KVFence | None = None
        self.handle_set: dict[str, Handle] = {}  # what the engine attached to (ESFT rows map into it)

    async def prepare(
        self, model_dir: str, options: EngineOptions, rank: int, dp: int, seed: Mapping[str, Handle] | None
    ) -> None:
        """Config and tokenizer, validated; no weights (a seed is not needed: attach maps in place)."""
        self.config = options.engine_config(model_dir, ep_rank=rank, ep_size=dp)
        await asyncio.to_thread(ModelConfig.from_pretrained, model_dir)
        self.tokenizer = await asyncio.to_thread(Tokenizer, model_dir, encodes=False)  # requests come as ids

    async def attach(
        self, handle_set: Mapping[str, Handle], placement: ExpertPlacement, group: Any, fence_kv: bool
    ) -> AttachReport:
        """Build the engine on HMM handles (weights used in place, KV pool = the device's pool).

        Without `num_kv_blocks` in the engine options the engine takes the whole device pool.
        `fence_kv`: the pool is still allocated by a serving rank (a kept device at a
        switchover); hold all its blocks until the first `import_requests`.
        """
        if self.config is None:
            raise RuntimeError("attach before build_skeleton")
        if self.engine is not None:
            raise RuntimeError("already attached")
        loader = ZeroCopyLoader(handle_set)
        self.handle_set = dict(handle_set)
        config = self.config
        if config.num_kv_blocks is None:
            config = dataclasses.replace(config, kv_cache_bytes=loader.kv_pool_bytes)
        t0 = time.perf_counter()
        if (loader.expert_cache is not None) != config.offloads_experts:
            raise RuntimeError("attach: the device has an expert cache exactly when the engine offloads experts")
        self.engine = await in_passing_thread(LLMEngine, config, loader.weights, loader.kv, placement, group,
                                              loader.expert_cache, self.tokenizer, name="engine-build")
        seconds = time.perf_counter() - t0
        self.core, self.group = self.engine, group
        if fence_kv:
            self.kv_fence = KVFence(self.engine.block_manager)
        report = check_zero_copy(self.engine.weights, loader.weights.opened, self.engine.kv_pool, seconds)
        return dataclasses.replace(report, compute=self.engine.compute_info())

    def _engine(self) -> LLMEngine:
        if self.engine is None:
            raise RuntimeError("rank: not attached")
        return self.engine

    async def warm_up(self, request: EngineRequest) -> None:
        """A fenced rank sends nothing (it has no KV block yet); it still steps in lockstep with the
        ranks that warm up, so its forward runs too (on an empty batch)."""
        if self.kv_fence is None:
            await super().warm_up(request)

    def counters(self) -> EngineCounters:
        # NOTE: read from the actor thread while the loop thread steps: each counter is a
        # consistent int, but the set of them is not one snapshot (fine for routing).
        engine, loop = self.engine, super().counters()
        if engine is None:
            return loop
        bm = engine.block_manager
        offload = engine.offload.stats() if engine.offload is not None else {}
        return dataclasses.replace(loop, num_kv_blocks=bm.num_blocks, num_free_kv_blocks=bm.num_free_blocks,
                                   lora=engine.adapters.stats(), arrange_us=int(engine.scheduler.arrange_s * 1e6),
                                   num_prefix_cache_queries=bm.prefix_queries, num_prefix_cache_hits=bm.prefix_hits,
                                   expert_cache={k: v for k, v in offload.items() if isinstance(v, int)})

    def _import(self, snaps: list[RequestSnapshot], kv_is_shared: bool) -> dict[str, int]:
        """`kv_is_shared`: this rank's pool is the exporter's (same device): block tables are
        claimed, nothing is recomputed. The first import releases this rank's `KVFence`."""
        engine = self._engine()
        if self.kv_fence is not None:
            self.kv_fence.release()
            self.kv_fence = None
        engine.import_requests(snaps, kv_is_shared)
        return {s.request_id: engine.requests[s.request_id].num_computed_tokens for s in snaps}

    def _before_reinstate(self, snaps: Sequence[RequestSnapshot], kv_kept: bool) -> None:
        if kv_kept:  # the exported tables are still allocated here, owned by nobody
            for snap in snaps:
                self._engine().block_manager.release(list(snap.block_ids))

    async def shutdown(self) -> None:
        """Stop the loop and drop the engine (unmaps the handles)."""
        await super().shutdown()
        self.engine = None

    # ---- expert offloading (FineMoE) -------------------------------------------------------

    def expert_load(self) -> np.ndarray | None:
        """Tokens this rank routed per (MoE layer, expert); None before it has an engine."""
        return self.engine.expert_load() if self.engine is not None else None

    async def warm_expert_cache(self, popularity: np.ndarray) -> int:
        """Fill this rank's expert cache with its most used experts (before it serves)."""
        offload = self._engine().offload
        if offload is None:
            return 0
        return await self._on_loop(lambda: offload.cache.warm(popularity))

    # ---- adapters (ExpertWeave ESFT, MoLoRA LoRA) -----------------------------------------

    async def _on_loop(self, fn: Callable[[], Any]) -> Any:
        """Run `fn` on the engine thread: through the loop if it runs, else directly (warming up)."""
        if self.llm is not None and self.llm.is_ready:
            return await self.llm.run_on_loop(fn)
        return fn()

    async def load_esft_adapter(
        self, name: str, slot: int, experts: dict[int, tuple[int, ...]], pages: dict[str, list[SlotPages]] | None,
        usage_probability: float | None = None,
    ) -> int:
        engine, handles = self._engine(), self.handle_set
        for param, slot_pages in (pages or {}).items():
            handle = handles[param]
            assert isinstance(handle, VirtualTensorHandle)
            map_slot_pages(engine.weights[param], handle, slot_pages)
        return int(await self._on_loop(lambda: engine.adapters.load_esft(name, experts, None, slot=slot,
                                                                         usage_probability=usage_probability)))

    async def load_lora_adapter(self, name: str, path: str, usage_probability: float | None = None) -> int | None:
        engine = self._engine()
        adapter = await asyncio.to_thread(LoraAdapter.open, name, path, engine.model_config)
        dtype = engine.config.dtype
        factors = await in_passing_thread(lambda: {m: adapter.weights(m, dtype) for m in adapter.modules})
        return await self._on_loop(
            lambda: engine.adapters.load_lora(name, adapter.modules, lambda m, _: factors[m], adapter.config.scaling,
                                              usage_probability=usage_probability)
        )

    async def load_lora_router(self, name: str, router: Any, usage_probability: float | None = None) -> None:
        engine = self._engine()
        await self._on_loop(lambda: engine.adapters.load_router(name, router, usage_probability))

    async def unload_adapter(self, name: str) -> bool:
        engine = self._engine()
        return bool(await self._on_loop(lambda: engine.adapters.unload(name)))

    async def adapter_in_use(self, name: str) -> bool:
        engine = self._engine()
        return bool(await self._on_loop(lambda: engine.adapters.in_use(name)))

    async def adapter_admitted(self, name: str) -> int:
        engine = self._engine()
        return int(await self._on_loop(lambda: engine.adapters.admitted(name)))

    async def finish_adapter_unload(self, name: str, rows: dict[str, list[int]]) -> None:
        engine, handles = self._engine(), self.handle_set
        await self._on_loop(lambda: engine.adapters.discard(name))
        for param, slots in rows.items():
            handle = handles[param]
            assert isinstance(handle, VirtualTensorHandle)
            unmap_slot_pages(engine.weights[param], handle, slots)

    def served_adapters(self) -> tuple[str, ...]:
        return tuple(self.engine.adapters.served) if self.engine is not None else ()
