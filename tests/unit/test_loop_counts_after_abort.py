"""A step loop's request counts follow an abort that leaves it idle: `num_running` /
`num_waiting` are what a rank's stats, `/metrics` and an instance's drain read. The lockstep
loop used to wait for its next command before counting, so a request whose client left stayed
"running" on an idle rank until another request came (a drain waited for it that long)."""

from __future__ import annotations

import asyncio
import contextlib
import time

import pytest
from fake_engine import FakeEngine

from elasticmoe.engine.async_llm import AsyncLLM
from elasticmoe.engine.engine_request import EngineRequest
from elasticmoe.sampling_params import SamplingParams
from imm.lockstep_loop import LockstepAsyncLLM

LOOPS = {"async_llm": lambda engine: AsyncLLM(engine), "lockstep": lambda engine: LockstepAsyncLLM(engine, None)}


@pytest.mark.parametrize("loop", list(LOOPS))
def test_an_aborted_request_is_not_counted_once_the_loop_is_idle(loop):
    llm = LOOPS[loop](FakeEngine(max_model_len=100_000, step_delay_s=0.005))
    llm.start()
    try:
        async def leave_after_two_outputs() -> None:
            request = EngineRequest("r1", [11, 12], SamplingParams(max_tokens=50_000, ignore_eos=True))
            async with contextlib.aclosing(llm.generate(request)) as outputs:
                await anext(outputs)
                await anext(outputs)
                assert llm.num_running == 1
            # the client left after two outputs: aclosing aborted the request

        asyncio.run(leave_after_two_outputs())
        deadline = time.monotonic() + 10
        while llm.num_running or llm.num_waiting:  # no other command comes
            assert time.monotonic() < deadline, (llm.num_running, llm.num_waiting)
            time.sleep(0.01)
    finally:
        llm.shutdown()

