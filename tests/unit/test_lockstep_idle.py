"""An idle EP instance's lockstep loops back off, and the rank a request reaches wakes its peers.

Two processes form a gloo group and run `LockstepAsyncLLM` over a `FakeEngine` each (no model,
no Ray); a peer's `wake` travels over a multiprocessing queue, as it travels as an actor call
between `InstanceRank`s. Idle, the loops run a few rounds a second, not hundreds; then both
loops' waits are set to two minutes, and a request that reaches rank 0 still finishes at once:
its rank woke rank 1 instead of leaving it in its wait (without the wake the request would wait
the two minutes, past the test's one-minute bound).
"""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
import torch.distributed as dist
import torch.multiprocessing as mp

from elasticmoe.utils.ports import free_port

pytestmark = pytest.mark.slow

IDLE_S = 1.0
LONG_WAIT_S = 120.0


def _worker(rank: int, port: int, wakes_in, wakes_out, results) -> None:
    from fake_engine import FakeEngine

    from elasticmoe.engine.engine_request import EngineRequest
    from elasticmoe.sampling_params import SamplingParams
    from imm.lockstep_loop import LockstepAsyncLLM

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    llm = None
    try:
        llm = LockstepAsyncLLM(FakeEngine(), dist.group.WORLD, max_idle_wait_s=LONG_WAIT_S,
                               wake_peers=lambda: wakes_out.put("wake"))
        received = []

        def listen() -> None:  # the peer's messages: what `InstanceRank.wake` does on an actor call
            while (msg := wakes_in.get()) != "stop":
                received.append(msg)
                llm.wake()

        threading.Thread(target=listen, daemon=True).start()
        llm.start()
        time.sleep(IDLE_S)
        idle_rounds = llm.num_rounds
        # Both loops now wait two minutes per idle round (from the round after this one).
        llm.max_idle_wait_s = llm._idle_wait_s = LONG_WAIT_S
        start = llm.num_rounds
        while llm.num_rounds == start:
            time.sleep(0.01)
        time.sleep(0.2)  # both in their long wait now
        tokens: list[int] = []
        if rank == 0:
            async def one() -> None:
                params = SamplingParams(max_tokens=3, ignore_eos=True)
                async for out in llm.generate(EngineRequest("r0", [5, 6, 7], params)):
                    tokens.extend(out.new_token_ids)

            asyncio.run(asyncio.wait_for(one(), timeout=60))
        else:
            while llm.num_steps < 3:  # rank 1 steps with rank 0 (empty forwards) until r0 is done
                time.sleep(0.01)
        results.put((rank, {"idle_rounds": idle_rounds, "tokens": tokens, "wakes_sent": llm.num_wakes_sent,
                            "wakes_received": len(received), "steps": llm.num_steps}))
    except BaseException as e:  # report instead of leaving the parent waiting
        results.put((rank, f"rank {rank} failed: {e!r}"))
        raise
    finally:
        if llm is not None:
            llm.max_idle_wait_s = 0.002
            llm.shutdown()  # a stop wakes the peer too (its loop leaves in the same round)
        wakes_out.put("stop")
        dist.destroy_process_group()


def test_idle_ranks_back_off_and_a_request_wakes_the_peers():
    ctx = mp.get_context("spawn")
    to_rank = [ctx.Queue(), ctx.Queue()]
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_worker, args=(r, port, to_rank[r], to_rank[1 - r], results)) for r in range(2)]
    for p in procs:
        p.start()
    try:
        got = dict(results.get(timeout=120) for _ in procs)
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    failures = [r for r in got.values() if isinstance(r, str)]
    assert not failures, failures
    r0, r1 = got[0], got[1]
    # A fixed 2 ms wait ran ~500 idle rounds a second; the back-off runs a handful.
    assert r0["idle_rounds"] < 30 and r1["idle_rounds"] < 30, (r0, r1)
    assert r0["tokens"] == [100, 101, 102]
    assert r0["wakes_sent"] >= 1 and r1["wakes_received"] >= 1, (r0, r1)
    assert r0["steps"] == r1["steps"] >= 3  # lockstep: the same number of steps on both ranks
