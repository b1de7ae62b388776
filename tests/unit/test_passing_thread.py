"""`in_passing_thread`: torch work off the engine's thread takes its OpenMP team with it.

In a subprocess (a process of its own threads): a parallel matmul on an `asyncio.to_thread` pool
thread leaves that thread and its OpenMP worker alive (a second team, which made every rank's
OpenMP worker sleep and wake at each parallel region); on a passing thread both are gone after.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys

import pytest

from elasticmoe.utils.passing_thread import in_passing_thread

SCRIPT = """
import asyncio, os, sys, time, torch
from elasticmoe.utils.passing_thread import in_passing_thread

def threads():
    return len(os.listdir("/proc/self/task"))

def work():
    torch.set_num_threads(2)
    a = torch.randn(512, 512)
    for _ in range(5):
        a @ a  # a parallel region: this thread's OpenMP team of 2
    return "done"

def settled():  # the thread count once threads that are leaving have left (stable for 0.2 s)
    count, deadline = threads(), time.monotonic() + 5
    while time.monotonic() < deadline:
        time.sleep(0.2)
        if threads() == count:
            return count
        count = threads()
    return count

async def main(how):
    await in_passing_thread(work)  # torch's own first-use thread (not OpenMP's) is made here
    before = settled()
    run = in_passing_thread(work) if how == "passing" else asyncio.to_thread(work)
    assert await run == "done"
    print(settled() - before)

asyncio.run(main(sys.argv[1]))
"""


@pytest.mark.parametrize("how,left", [("passing", 0), ("to_thread", 2)])
def test_the_threads_team_leaves_with_it(how, left):
    out = subprocess.run([sys.executable, "-c", SCRIPT, how], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert int(out.stdout) == left  # to_thread: its pool thread and that thread's OpenMP worker


def test_result_and_exception_reach_the_caller():
    def fail():
        raise ValueError("bad")

    async def main():
        assert await in_passing_thread(lambda a, b: a + b, 2, 3) == 5
        with pytest.raises(ValueError, match="bad"):
            await in_passing_thread(fail)

    asyncio.run(main())


def test_a_cancelled_caller_leaves_the_work_to_finish():
    import threading

    finished = threading.Event()
    release = threading.Event()

    def slow():
        release.wait(5)
        finished.set()
        return 1

    async def main():
        task = asyncio.create_task(in_passing_thread(slow))
        await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        release.set()
        await asyncio.to_thread(finished.wait, 5)  # the late result is dropped, nothing raises

    asyncio.run(main())
    assert finished.is_set()
