"""The single-process server's `AdapterHost` (`adapters_api`): adapters opened, validated and read
in this process, then copied into its one engine's slots."""

from __future__ import annotations

import asyncio
from typing import Any

from elasticmoe.adapters.esft import EsftAdapter
from elasticmoe.adapters.lora import LoraAdapter
from elasticmoe.adapters.lora_router import LoraRouter
from elasticmoe.utils.passing_thread import in_passing_thread


class EngineAdapterHost:
    """Adapters of one `AsyncLLM`'s engine. The weights are read from disk in a worker thread;
    the engine thread only copies them into their slot rows, so serving does not pause. ESFT
    adapters beyond the slots are registered on disk and swapped in when a request needs one
    (`engine.esft_disk_tier`: that read is on the engine thread)."""

    def __init__(self, async_llm: Any) -> None:
        self.async_llm = async_llm

    @property
    def engine(self) -> Any:
        return self.async_llm.engine

    async def load_esft(self, name: str, path: str, usage_probability: float | None = None) -> dict[str, Any]:
        engine = self.engine
        dtype = engine.config.dtype
        rank, placement = engine.config.ep_rank, engine.placement
        adapter = await asyncio.to_thread(EsftAdapter.open, name, path, engine.model_config)
        experts = adapter.config.experts
        weights = await in_passing_thread(read_expert_weights, adapter, rank, placement.expert_to_rank, dtype)
        adapter.close()  # read again from its files only if it is swapped out and back
        slot = await self.async_llm.run_on_loop(
            lambda: engine.adapters.load_esft(adapter.name, experts, lambda layer, e, _: weights[(layer, e)],
                                              usage_probability=usage_probability, files=adapter)
        )
        return {"slot": slot, "num_experts": sum(len(v) for v in experts.values())}

    async def load_lora(self, name: str, path: str, usage_probability: float | None = None) -> dict[str, Any]:
        engine = self.engine
        dtype = engine.config.dtype
        adapter = await asyncio.to_thread(LoraAdapter.open, name, path, engine.model_config)
        factors = await in_passing_thread(lambda: {m: adapter.weights(m, dtype) for m in adapter.modules})
        slot = await self.async_llm.run_on_loop(
            lambda: engine.adapters.load_lora(adapter.name, adapter.modules, lambda m, _: factors[m],
                                             adapter.config.scaling, usage_probability=usage_probability)
        )
        return {"slot": slot, "rank": adapter.config.r, "num_modules": len(adapter.modules)}

    async def load_router(self, name: str, path: str, usage_probability: float | None = None) -> dict[str, Any]:
        engine = self.engine
        router = await asyncio.to_thread(LoraRouter.open, path)
        await self.async_llm.run_on_loop(lambda: engine.adapters.load_router(name, router, usage_probability))
        return {"adapters": list(router.adapters), "top_k": router.top_k}

    async def unload(self, name: str) -> bool:
        engine = self.engine
        return bool(await self.async_llm.run_on_loop(lambda: engine.adapters.unload(name)))

    async def describe(self) -> list[dict[str, Any]]:
        engine = self.engine
        return list(await self.async_llm.run_on_loop(engine.adapters.describe))


def read_expert_weights(
    adapter: EsftAdapter, rank: int, expert_to_rank: tuple[int, ...], dtype: Any
) -> dict[tuple[int, int], tuple[Any, Any]]:
    """(layer, expert) -> (w13, w2) of the tuned experts `rank` holds (blocking)."""
    return {
        (layer, e): adapter.expert_weights(layer, e, dtype)
        for layer, ids in adapter.config.experts.items()
        for e in ids
        if expert_to_rank[e] == rank
    }
