"""Handover between two single-rank `LockstepAsyncLLM`s on private KV pools (no Ray): pause
mid-stream keeps the consumers waiting; export ends each stream with `HandedOver` right after
its last delta; the importer recomputes the KV (`kv_is_shared=False`) and `resume` streams
the rest. Spliced deltas equal an engine run without a handover; a paused loop refuses new
requests; the KV fence holds every block until released. Also the snapshot assignment."""

from __future__ import annotations

import asyncio

import pytest
import torch

from elasticmoe.config import EngineConfig
from elasticmoe.engine.async_llm import EngineDeadError
from elasticmoe.engine.block_manager import BlockManager
from elasticmoe.engine.engine_request import EngineRequest
from elasticmoe.engine.handover import RequestSnapshot
from elasticmoe.engine.llm_engine import LLMEngine
from elasticmoe.sampling_params import SamplingParams
from imm.handover import HandedOver, KVFence, assign_snapshots
from imm.lockstep_loop import LockstepAsyncLLM

REQUESTS = {
    "greedy": ([5, 6, 7, 8, 9, 10], SamplingParams(temperature=0.0, max_tokens=300, ignore_eos=True)),
    "sampled": ([20, 21, 22], SamplingParams(temperature=0.9, seed=3, max_tokens=250, ignore_eos=True)),
}


def _engine(model_dir: str) -> LLMEngine:
    return LLMEngine(EngineConfig(model=model_dir, dtype=torch.float32, num_kv_blocks=128, num_threads=1))


def test_pause_export_import_resume_splices_streams(tiny_model_dir):
    reference = _engine(tiny_model_dir)
    for rid, (prompt, params) in REQUESTS.items():
        reference.add_request(rid, prompt, params)
    expected = {}
    while reference.has_unfinished_requests():
        expected.update({o.request_id: o.output_token_ids for o in reference.step() if o.finished})

    old, new = LockstepAsyncLLM(_engine(tiny_model_dir), None), LockstepAsyncLLM(_engine(tiny_model_dir), None)
    old.start()
    new.start()

    async def main() -> dict[str, list]:
        outs: dict[str, list] = {rid: [] for rid in REQUESTS}
        started = asyncio.Event()
        moved: dict[str, bool] = {}

        async def consume(rid: str) -> None:
            prompt, params = REQUESTS[rid]
            try:
                async for out in old.generate(EngineRequest(rid, prompt, params)):
                    outs[rid].append(out)
                    if len(outs[rid]) == 2 and all(outs.values()):
                        started.set()
            except HandedOver as marker:
                assert marker.request_id == rid
                moved[rid] = True
                async for out in new.resume(rid):
                    outs[rid].append(out)

        tasks = [asyncio.create_task(consume(rid)) for rid in REQUESTS]
        await started.wait()
        await asyncio.to_thread(old.pause)
        assert old.is_paused and not any(o[-1].finished for o in outs.values())
        with pytest.raises(EngineDeadError):
            await anext(old.generate(EngineRequest("late", [1, 2], SamplingParams(max_tokens=2))))
        old.apply_queued_commands()
        snaps = old.engine.export_requests(hand_over_kv=False)  # type: ignore[attr-defined]
        old.hand_over_streams([s.request_id for s in snaps])
        ids = [s.request_id for s in snaps]
        new.adopt_streams(ids)
        engine = new.engine

        def work() -> dict[str, int]:
            engine.import_requests(snaps, kv_is_shared=False)  # type: ignore[attr-defined]
            return {r: engine.requests[r].num_computed_tokens for r in ids}  # type: ignore[attr-defined]

        computed = await new.run_on_loop(work)
        assert computed == {r: 0 for r in ids}  # private pools: recompute from the tokens
        await asyncio.gather(*tasks)
        assert moved == {rid: True for rid in REQUESTS}
        return outs

    try:
        outs = asyncio.run(main())
    finally:
        old.shutdown()
        new.shutdown()
    for rid, stream in outs.items():
        assert stream[-1].finished and stream[-1].finish_reason == "length"
        assert [t for o in stream for t in o.new_token_ids] == stream[-1].output_token_ids  # no dup, no gap
        assert "".join(o.new_text for o in stream) == stream[-1].text
        assert stream[-1].output_token_ids == expected[rid], rid


def test_resume_after_the_imported_request_already_finished(tiny_model_dir):
    """Under load a client's `resume` can arrive after its (short) request finished on the new
    rank: the adopted stream must still deliver every output (seen once as a 500 KeyError)."""
    old, new = LockstepAsyncLLM(_engine(tiny_model_dir), None), LockstepAsyncLLM(_engine(tiny_model_dir), None)
    old.start()
    new.start()
    params = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)  # long enough to be paused

    async def main() -> list:
        outs: list = []
        stream = old.generate(EngineRequest("short", [5, 6, 7], params))
        outs.append(await anext(stream))
        await asyncio.to_thread(old.pause)
        old.apply_queued_commands()
        snaps = old.engine.export_requests(hand_over_kv=False)  # type: ignore[attr-defined]
        assert [s.request_id for s in snaps] == ["short"]
        old.hand_over_streams([s.request_id for s in snaps])
        with pytest.raises(HandedOver):
            async for out in stream:  # the outputs of the steps before the pause, then the marker
                outs.append(out)
        new.adopt_streams(["short"])
        await new.run_on_loop(lambda: new.engine.import_requests(snaps, kv_is_shared=False))  # type: ignore[attr-defined]
        for _ in range(500):  # let it run to the end before anyone resumes it
            if not new.engine.has_unfinished_requests():
                break
            await asyncio.sleep(0.01)
        assert not new.engine.has_unfinished_requests()
        async for out in new.resume("short"):
            outs.append(out)
        with pytest.raises(KeyError):  # resumed once only
            await anext(new.resume("short"))
        return outs

    try:
        outs = asyncio.run(main())
    finally:
        old.shutdown()
        new.shutdown()
    assert outs[-1].finished and len(outs[-1].output_token_ids) == 64
    assert [t for o in outs for t in o.new_token_ids] == outs[-1].output_token_ids


def test_kv_fence_holds_every_block_until_released():
    bm = BlockManager(8, 16)
    fence = KVFence(bm)
    assert bm.num_free_blocks == 0
    fence.release()
    assert bm.num_free_blocks == 8
    bm.claim([3, 4])
    with pytest.raises(RuntimeError, match="already has allocated"):
        KVFence(bm)


def _snap(rid: str) -> RequestSnapshot:
    return RequestSnapshot(
        rid, (1, 2), 2, SamplingParams(), 8, 0.0, 0, (), False, None, (), 0, "", 0, 0
    )


def test_assign_snapshots_keeps_kept_devices_and_balances_the_rest():
    by_device = {0: [_snap("a"), _snap("b")], 2: [_snap("c"), _snap("d"), _snap("e")]}
    plan = assign_snapshots(by_device, device_ids=[0, 1], loads=[0, 1])
    assert [s.request_id for s in plan[0][0]] == ["a", "b"] and plan[1][0] == []
    # Loads after the kept ones: rank 0 has 2, rank 1 has 1 -> c to 1, d to 0 (tie, lower rank), e to 1.
    assert [s.request_id for s in plan[1][1]] == ["c", "e"] and [s.request_id for s in plan[0][1]] == ["d"]
