"""Shared by the chaos tests: the undisturbed streams of a server and one injected fault, both
through `coordinator.bench.chaos_faults` with the same seeded prompts."""

from __future__ import annotations

import asyncio

import httpx

from coordinator.bench.chaos import prompts
from coordinator.bench.chaos_faults import FaultResult, run_fault, settle, undisturbed
from coordinator.launch import ElasticServer

MODEL, MAX_TOKENS = "tiny-qwen3-moe", 160
PROMPTS = prompts(4, 12, 512, seed=0)


def reference_streams(server: ElasticServer, dp: int) -> list[str]:
    """The streams' text at `dp` with nothing disturbed."""
    async def main() -> list[str]:
        async with httpx.AsyncClient(base_url=server.url, timeout=120) as c:
            await settle(c, dp)
            return await undisturbed(c, MODEL, PROMPTS, MAX_TOKENS)

    return asyncio.run(main())


def inject(server: ElasticServer, reference: list[str], fault: str, dp: int) -> FaultResult:
    """Settle at `dp`, then run the streams while `fault` is injected (printed for the log)."""
    async def main() -> FaultResult:
        async with httpx.AsyncClient(base_url=server.url, timeout=300) as c:
            await settle(c, dp)
            return await run_fault(c, fault, MODEL, PROMPTS, reference, MAX_TOKENS,
                                   shm_prefix=server.config.shm_prefix)

    result = asyncio.run(main())
    print(f"\n{result.to_dict()}")
    return result
