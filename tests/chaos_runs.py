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


def assert_an_offloading_server_loses_nothing(server: ElasticServer, reference: list[str], fault: str, dp: int) -> None:
    """`fault` at `dp` on a server whose devices hold expert caches: no request failed, every stream
    equals `reference`, the repair shows as an event, no /dev/shm file lost its owner, and the server
    is ready again with an expert cache on every device."""
    r = inject(server, reference, fault, dp)
    assert (r.failed, r.identical) == (0, r.requests), r.errors
    assert r.recover_s is not None and r.events, "the repair left no event"
    assert r.orphaned_shm_files == 0
    with httpx.Client(base_url=server.url) as c:
        assert c.get("/ready").status_code == 200
        status = c.get("/admin/status").json()
    assert status["expert_cache"] and all(row["capacity_experts"] > 0 for row in status["expert_cache"])


# The kills of an offloading server: a device worker under rank 0 at dp 2, and the old instance's rank
# while a scale 1 -> 2 prepares (`inject`'s faults).
OFFLOAD_FAULTS = [("device", 2), ("mid-scale", 1)]
OFFLOAD_FAULT_IDS = ["device-worker", "old-rank-mid-scale"]
