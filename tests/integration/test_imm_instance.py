"""An Instance of dp=2 on HMM handles (tiny Qwen3-MoE, 2 logical devices, float32):
standby -> attached (zero-copy, no disk read in the ranks) -> warm -> active;
greedy streams on both ranks equal a single-process engine while one rank idles;
abort mid-stream frees the blocks; drain waits for in-flight work; retire kills
the actors; illegal transitions raise; with a process pool the next instance's ranks run in the
retired ranks' processes (a dead one replaced, a live rank's process refused) with equal tokens."""

from __future__ import annotations

import os
import pickle
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import ray
import torch
from ray_hmm import ray_hmm

from elasticmoe.config import EngineConfig, EngineOptions
from elasticmoe.engine.engine_request import EngineRequest
from elasticmoe.engine.llm_engine import LLMEngine
from elasticmoe.outputs import OutputAccumulator
from elasticmoe.sampling_params import SamplingParams
from hmm.memory.segments import mapped_segments
from imm.instance import Instance
from imm.lifecycle import IllegalTransition, InstanceState
from imm.manager import InstanceManager, instance_factory
from imm.rank_processes import RankProcessPool

pytestmark = pytest.mark.slow

BUDGET, KV, PAGE = 32 << 20, 1 << 20, 4096
OPTIONS = EngineOptions(dtype=torch.float32, num_threads=1)
PROMPTS = {0: ([5, 6, 7, 8, 9, 10], 20), 1: ([11, 12, 13], 4)}  # rank 1 finishes early and idles


def _greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


@pytest.fixture(scope="module")
def hmm(tiny_model_dir):
    with ray_hmm(tiny_model_dir, dp=2, budget=BUDGET, kv_bytes=KV, page=PAGE) as ctl:
        yield ctl


def _reference(model_dir: str, prompt: list[int], max_tokens: int) -> list[int]:
    engine = LLMEngine(EngineConfig(model=model_dir, dtype=torch.float32, num_kv_blocks=64))
    engine.add_request("ref", prompt, _greedy(max_tokens))
    outs = []
    while engine.has_unfinished_requests():
        outs += engine.step()
    return outs[-1].output_token_ids


def _stream(rank, request_id: str, prompt: list[int], params: SamplingParams, on_output=None) -> list:
    outs, acc = [], OutputAccumulator(prompt)
    for ref in rank.generate.remote(EngineRequest(request_id, prompt, params)):
        item = ray.get(ref)
        # Only the delta travels: an item's size does not grow with the prompt or the output so far.
        assert len(pickle.dumps(item)) < 400 and len(item.new_token_ids) <= 2, item
        outs.append(acc.add(item))
        if on_output is not None:
            on_output(outs)
    return outs


def _wait(predicate, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.02)


def test_instance_lifecycle_on_hmm_handles(hmm, tiny_model_dir):
    t0 = time.perf_counter()
    inst = Instance.create_standby(tiny_model_dir, dp=2, engine_options=OPTIONS)
    try:
        assert inst.state is InstanceState.STANDBY
        with pytest.raises(IllegalTransition):
            inst.warm_up()  # no engine yet
        assert inst.state is InstanceState.STANDBY

        reports = inst.attach(hmm)
        assert inst.state is InstanceState.ATTACHED
        assert all(r.is_zero_copy for r in reports), reports  # weights are the mapped HMM tensors
        with pytest.raises(IllegalTransition):
            inst.activate()  # not warm

        inst.warm_up()
        inst.activate()
        assert inst.state is InstanceState.ACTIVE and inst.is_serving
        with pytest.raises(IllegalTransition):
            inst.attach(hmm)
        t_ready = time.perf_counter() - t0

        # Both ranks at once; rank 1 finishes after 4 tokens and runs empty steps for rank 0.
        with ThreadPoolExecutor(2) as pool:
            futures = {
                r: pool.submit(_stream, inst.ranks[r], f"req{r}", p, _greedy(n)) for r, (p, n) in PROMPTS.items()
            }
            streams = {r: f.result(timeout=120) for r, f in futures.items()}
        for r, (prompt, n) in PROMPTS.items():
            outs = streams[r]
            assert outs[-1].finished and outs[-1].finish_reason == "length"
            assert [t for o in outs for t in o.new_token_ids] == outs[-1].output_token_ids
            assert outs[-1].output_token_ids == _reference(tiny_model_dir, prompt, n), r
        # lockstep: the same steps on both ranks (a rank's counter may trail its last output a moment)
        deadline = time.monotonic() + 10
        while (stats := inst.stats())[0].num_steps != stats[1].num_steps:
            assert time.monotonic() < deadline, stats
            time.sleep(0.05)
        assert inst.least_loaded_rank() == 0  # all idle: the lowest rank

        # Abort mid-stream: the stream ends with "abort" and the blocks come back.
        rank0 = inst.ranks[0]

        def abort_after_3(outs: list) -> None:
            if len(outs) == 3:
                ray.get(rank0.abort.remote("long"))

        outs = _stream(rank0, "long", list(range(20, 60)), _greedy(200), abort_after_3)
        assert outs[-1].finish_reason == "abort" and len(outs) < 50
        _wait(lambda: (s := inst.stats()[0]).num_free_kv_blocks == s.num_kv_blocks and s.num_running == 0)

        # Cancelling the Ray generator (client gone) aborts the request in the engine.
        steps_before = inst.stats()[1].num_steps
        gen = inst.ranks[1].generate.remote(EngineRequest("gone", list(range(20, 60)), _greedy(200)))
        ray.get(next(gen))
        ray.cancel(gen)
        _wait(lambda: (s := inst.stats()[1]).num_free_kv_blocks == s.num_kv_blocks and s.num_running == 0)
        assert inst.stats()[1].num_steps - steps_before < 150  # stopped early, did not run to 200 tokens

        # Drain waits for the request in flight; then retire removes the actors.
        with ThreadPoolExecutor(1) as pool:
            fut = pool.submit(_stream, inst.ranks[1], "last", [7, 8, 9], _greedy(12))
            _wait(lambda: inst.stats()[1].num_running > 0 or fut.done())
            assert inst.drain(timeout_s=60)
            assert fut.result(timeout=60)[-1].finish_reason == "length"
        assert inst.state is InstanceState.DRAINING and not inst.is_serving
        ranks = list(inst.ranks)
        inst.retire()
        assert inst.state is InstanceState.RETIRED and inst.ranks == []
        for rank in ranks:
            _wait_until_dead(rank)
        with pytest.raises(IllegalTransition):
            inst.activate()
        print(f"\nimm timings: ready {t_ready:.2f}s, phases {inst.timings}")
    finally:
        if inst.state is not InstanceState.RETIRED:
            inst.retire()


def test_manager_pools_standby_instances(hmm, tiny_model_dir):
    mgr = InstanceManager(instance_factory(tiny_model_dir, OPTIONS), capacity=1)
    inst = None
    try:
        mgr.prepare([1])
        dp1 = mgr.pool[1]
        mgr.prepare([2])  # capacity 1: the dp=1 standby is evicted and its actor killed
        assert list(mgr.pool) == [2] and dp1.state is InstanceState.RETIRED
        inst = mgr.take(2)
        assert mgr.num_hits == 1 and inst.state is InstanceState.STANDBY
        t0 = time.perf_counter()
        inst.attach(hmm)
        inst.warm_up()
        inst.activate()
        switch_s = time.perf_counter() - t0
        prompt, n = PROMPTS[0]
        outs = _stream(inst.ranks[inst.least_loaded_rank()], "m", prompt, _greedy(n))
        assert outs[-1].output_token_ids == _reference(tiny_model_dir, prompt, n)
        print(f"\nstandby dp=2 -> active in {switch_s:.3f}s (attach + warm-up + activate)")
    finally:
        mgr.shutdown()
        if inst is not None:
            inst.retire()  # handed out: the caller's to retire, not the pool's
    assert inst.state is InstanceState.RETIRED and not mgr.pool


def test_a_retired_instances_processes_host_the_next_instances_ranks(hmm, tiny_model_dir):
    pool = RankProcessPool(capacity=2)
    instances: list[Instance] = []
    prompt, n = PROMPTS[0]
    want = _reference(tiny_model_dir, prompt, n)

    def serving() -> Instance:
        inst = Instance.create_standby(tiny_model_dir, dp=2, engine_options=OPTIONS, processes=pool)
        instances.append(inst)
        inst.attach(hmm)
        inst.warm_up()
        inst.activate()
        for r in range(2):  # both ranks step in lockstep, whichever process hosts them
            assert _stream(inst.ranks[r], f"{inst.instance_id}-{r}", prompt, _greedy(n))[-1].output_token_ids == want
        return inst

    try:
        first = serving()
        assert first.num_reused == 0
        first_pids = sorted(ray.get([r.pid.remote() for r in first.ranks]))
        first_engines = {s.engine_id for s in first.stats()}
        # What `reuse` checks is gone: a serving rank maps its device's segments.
        assert all(mapped_segments(pid) for pid in first_pids)
        # A warm rank's startup heap is out of the collector's full passes; a rank that shut down gave
        # it back, or its engine's cycles would keep the segments mapped (elasticmoe.utils.gc_heap)
        first_ranks = list(first.ranks)
        assert all(n > 0 for n in ray.get([r.frozen_objects.remote() for r in first_ranks]))
        first.retire()
        assert ray.get([r.frozen_objects.remote() for r in first_ranks]) == [0, 0]
        assert sorted(p["pid"] for p in pool.status()["idle"]) == first_pids  # kept, not killed

        # One pooled process dies while idle: the next instance starts a new one in its place.
        dead_pid, alive_pid = first_pids
        os.kill(dead_pid, signal.SIGKILL)
        second = serving()
        assert second.num_reused == 1 and len(pool) == 0
        second_pids = ray.get([r.pid.remote() for r in second.ranks])
        assert alive_pid in second_pids and dead_pid not in second_pids
        assert not first_engines & {s.engine_id for s in second.stats()}  # fresh engines, fresh counters

        # A serving rank's process is never reused: it has not shut down.
        with pytest.raises(ray.exceptions.RayTaskError, match="has not shut down"):
            ray.get(second.ranks[0].reuse.remote(0, 2))
        ranks = list(second.ranks)
        second.retire()
        assert len(pool) == 2
        pool.close()  # the coordinator's shutdown: the idle processes exit
        for rank in ranks:
            _wait_until_dead(rank)
        assert pool.give([]) == [] and len(pool) == 0
    finally:
        for inst in instances:
            if inst.state is not InstanceState.RETIRED:
                inst.retire()
        pool.close()


def _wait_until_dead(actor, timeout_s: float = 30.0) -> None:
    """`ray.kill` is asynchronous: a call sent right after it may still be served once."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            ray.get(actor.stats.remote(), timeout=5)
        except ray.exceptions.RayActorError:
            return
        time.sleep(0.1)
    pytest.fail(f"actor {actor} still alive {timeout_s:.0f}s after retire")
