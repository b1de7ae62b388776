"""The bench tests' runner: a bench that overruns is stopped with Ctrl-C (its own cleanup runs)
and the test fails with the end of its log, not with a bare timeout and orphaned servers."""

from __future__ import annotations

import signal
import sys

import pytest
from bench_runs import run_bench

STUCK = ("import sys, time\n"
         "print('step 3: waiting for the server', file=sys.stderr, flush=True)\n"
         "try:\n    time.sleep(60)\n"
         "except KeyboardInterrupt:\n    print('stopped its servers', file=sys.stderr)\n    raise\n")


def test_an_overrunning_bench_is_interrupted_and_its_log_reported():
    # As in xdist's workers and in background jobs: a child would inherit SIGINT ignored.
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        with pytest.raises(pytest.fail.Exception) as info:
            run_bench([sys.executable, "-c", STUCK], timeout_s=2.0)  # its start takes ~0.05 s
    finally:
        signal.signal(signal.SIGINT, previous)
    message = str(info.value)
    assert "did not finish within 2 s; its log ends:" in message
    log = message.split("its log ends:")[1]
    # Interrupted, not waited out:
    assert "step 3: waiting for the server" in log and "stopped its servers" in log


def test_a_bench_that_finishes_returns_its_output():
    proc = run_bench([sys.executable, "-c", "print('{}')"], timeout_s=30.0)
    assert proc.returncode == 0 and proc.stdout == "{}\n"
