"""AsyncLLM over a fake engine: routing, early exit, errors, health, shutdown."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
from fake_engine import FakeEngine

from elasticmoe.engine.async_llm import AsyncLLM, EngineDeadError
from elasticmoe.engine.engine_request import EngineRequest
from elasticmoe.sampling_params import SamplingParams


def _wait_until(predicate, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached in time")
        time.sleep(0.005)


@pytest.fixture
def llm():
    engine = FakeEngine(step_delay_s=0.002)  # a request without max_tokens runs for ~0.1 s
    async_llm = AsyncLLM(engine, stall_timeout_s=0.2)
    async_llm.start()
    yield async_llm
    async_llm.shutdown()


async def _collect(async_llm: AsyncLLM, rid: str, max_tokens: int = 3):
    return [out async for out in async_llm.generate(EngineRequest(rid, "a bb ccc", SamplingParams(max_tokens=max_tokens)))]


def test_concurrent_requests_are_routed_and_finish(llm):
    async def main():
        return await asyncio.gather(*(_collect(llm, f"r{i}", max_tokens=2 + i) for i in range(4)))

    results = asyncio.run(main())
    for i, outs in enumerate(results):
        assert {o.request_id for o in outs} == {f"r{i}"}
        assert len(outs) == 2 + i and outs[-1].finished and not any(o.finished for o in outs[:-1])
        assert "".join(o.new_text for o in outs) == outs[-1].text
    engine = llm.engine
    assert engine.thread_ids == {llm._thread.ident}, "engine touched outside the loop thread"
    assert not engine.requests


def test_add_request_error_reaches_the_caller(llm):
    async def main():
        with pytest.raises(ValueError) as info:
            async for _ in llm.generate(EngineRequest("too-long", list(range(100)), SamplingParams())):
                pass
        return info.value

    err = asyncio.run(main())
    assert err.param == "prompt"
    assert llm.is_ready  # the loop survives bad input


@pytest.mark.parametrize("how", ["break", "cancel"])
def test_consumer_leaving_early_aborts_in_engine(llm, how):
    async def consume():
        async for out in llm.generate(EngineRequest("r", "x", SamplingParams(max_tokens=None))):
            if how == "break":
                break
            assert out.new_text

    async def main():
        if how == "break":
            gen = consume()
            await gen
        else:
            task = asyncio.create_task(consume())
            await asyncio.sleep(0.05)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task

    asyncio.run(main())
    _wait_until(lambda: "r" in llm.engine.aborted)
    assert not llm.engine.requests and not llm._streams


def test_abort_from_outside_ends_the_stream(llm):
    async def main():
        outs = []
        async for out in llm.generate(EngineRequest("r", "x", SamplingParams(max_tokens=None))):
            outs.append(out)
            if len(outs) == 2:
                await llm.abort("r")
        return outs

    outs = asyncio.run(main())
    assert outs[-1].finished and outs[-1].finish_reason == "abort"
    _wait_until(lambda: not llm.engine.requests)


def test_idle_loop_blocks_instead_of_spinning(llm):
    asyncio.run(_collect(llm, "r"))
    time.sleep(0.05)
    steps = llm.engine.num_steps
    time.sleep(0.3)
    assert llm.engine.num_steps == steps
    llm.check_health()  # idle for longer than stall_timeout_s is healthy


def test_stalled_loop_fails_health_check(llm):
    release = threading.Event()
    llm.engine.step_hook = lambda: release.wait(5)

    async def main():
        task = asyncio.create_task(_collect(llm, "r"))
        await asyncio.sleep(0.4)
        with pytest.raises(EngineDeadError):
            llm.check_health()
        release.set()
        await task

    asyncio.run(main())
    llm.check_health()


class _Fatal(BaseException):
    """Not an `Exception`: what a step cannot survive (the loop itself ends)."""


def test_a_step_that_raises_fails_its_requests_not_the_loop():
    engine = FakeEngine()
    failures = []

    def crash_once() -> None:
        if not failures:
            failures.append(1)
            raise RuntimeError("boom")

    engine.step_hook = crash_once
    llm = AsyncLLM(engine)
    llm.start()
    outs = asyncio.run(_collect(llm, "r"))
    assert outs[-1].finished and outs[-1].finish_reason == "error" and "boom" in outs[-1].error
    assert llm.is_ready and llm.num_step_failures == 1
    llm.check_health()
    assert asyncio.run(_collect(llm, "r2"))[-1].finish_reason == "length"  # the next one is served
    llm.shutdown()


def test_loop_crash_fails_consumers_and_health():
    engine = FakeEngine()

    def fatal() -> None:
        raise _Fatal()

    engine.step_hook = fatal
    llm = AsyncLLM(engine)
    llm.start()
    with pytest.raises(EngineDeadError):
        asyncio.run(_collect(llm, "r"))
    _wait_until(lambda: not llm._thread.is_alive())
    assert not llm.is_ready
    with pytest.raises(EngineDeadError):
        llm.check_health()
    with pytest.raises(EngineDeadError):
        asyncio.run(_collect(llm, "r2"))
    llm.shutdown()


def test_shutdown_releases_waiting_consumers():
    engine = FakeEngine()
    release = threading.Event()
    engine.step_hook = lambda: release.wait(5)
    llm = AsyncLLM(engine)
    llm.start()

    async def main():
        task = asyncio.create_task(_collect(llm, "r"))
        await asyncio.sleep(0.05)
        stopper = asyncio.get_running_loop().run_in_executor(None, llm.shutdown)
        await asyncio.sleep(0.05)
        release.set()
        await stopper
        with pytest.raises(EngineDeadError):
            await task

    asyncio.run(main())
    assert not llm.is_ready
    llm.shutdown()  # idempotent


def test_start_builds_the_engine_on_the_thread_that_steps_it():
    """One OpenMP team per process: the engine is built where it steps (AsyncLLM.start)."""
    threads = set()
    engine = FakeEngine()
    engine.step_hook = lambda: threads.add(threading.get_ident())

    def build():
        threads.add(threading.get_ident())
        return engine

    llm = AsyncLLM()
    llm.start(build)
    try:
        assert llm.engine is engine
        assert len(asyncio.run(_collect(llm, "r0"))) > 0
        assert threads == {llm._thread.ident} and threading.get_ident() not in threads
    finally:
        llm.shutdown()


def test_a_build_that_fails_is_raised_by_start_and_leaves_no_thread():
    def build():
        raise ValueError("expert cache below top-k")

    llm = AsyncLLM()
    with pytest.raises(ValueError, match="top-k"):
        llm.start(build)
    assert llm._thread is None and not llm.is_ready
    llm.shutdown()  # still safe: nothing to stop


def test_the_test_knob_paces_steps_and_defaults_to_none(monkeypatch):
    """`ELASTICMOE_TEST_MIN_STEP_INTERVAL_S` (the e2e load modules' pacing): steps at least that far
    apart, tokens unchanged; unset, the loop steps back to back."""
    from elasticmoe.engine.async_llm import MIN_STEP_INTERVAL_ENV

    def run(interval: str | None) -> tuple[float, list[str]]:
        if interval is None:
            monkeypatch.delenv(MIN_STEP_INTERVAL_ENV, raising=False)
        else:
            monkeypatch.setenv(MIN_STEP_INTERVAL_ENV, interval)
        async_llm = AsyncLLM(FakeEngine())
        async_llm.start()
        try:
            t0 = time.monotonic()
            outs = asyncio.run(_collect(async_llm, "r", max_tokens=6))
            return time.monotonic() - t0, [o.new_text for o in outs]
        finally:
            async_llm.shutdown()

    _, free_text = run(None)
    paced_s, paced_text = run("0.05")
    assert paced_text == free_text and len(paced_text) == 6
    assert paced_s >= 5 * 0.05  # six steps, five gaps at least (a lower bound: never flaky)
    assert AsyncLLM(FakeEngine()).min_step_interval_s == 0.05
    monkeypatch.delenv(MIN_STEP_INTERVAL_ENV)
    assert AsyncLLM(FakeEngine()).min_step_interval_s == 0.0
