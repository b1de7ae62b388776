"""The bench tests' runner: a bench that overruns is stopped with Ctrl-C (its own cleanup runs)
and the test fails with the end of its log, not with a bare timeout and orphaned servers."""

from __future__ import annotations

import sys

import pytest
from bench_runs import run_bench

STUCK = ("import sys, time\n"
         "print('step 3: waiting for the server', file=sys.stderr, flush=True)\n"
         "try:\n    time.sleep(60)\n"
         "except KeyboardInterrupt:\n    print('stopped its servers', file=sys.stderr)\n    raise\n")


def test_an_overrunning_bench_is_interrupted_and_its_log_reported():
    with pytest.raises(pytest.fail.Exception) as info:
        run_bench([sys.executable, "-c", STUCK], timeout_s=2.0)  # its start takes ~0.05 s
    message = str(info.value)
    assert "did not finish within 2 s" in message
    assert "step 3: waiting for the server" in message and "stopped its servers" in message


def test_a_bench_that_finishes_returns_its_output():
    proc = run_bench([sys.executable, "-c", "print('{}')"], timeout_s=30.0)
    assert proc.returncode == 0 and proc.stdout == "{}\n"
