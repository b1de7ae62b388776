"""The thread the expert-offloading policy runs on: jobs in order on another thread, a failing job
logged and passed over, nothing lost at close or after it."""

from __future__ import annotations

import logging
import subprocess
import sys
import textwrap
import threading
import time

from elasticmoe.engine.policy_worker import PolicyWorker


def test_jobs_run_in_submission_order_on_another_thread():
    worker = PolicyWorker()
    ran: list[tuple[int, str]] = []
    release = threading.Event()
    worker.submit(lambda: release.wait(5))  # the jobs below queue behind this one
    for i in range(50):
        worker.submit(lambda i=i: ran.append((i, threading.current_thread().name)))
    assert worker.busy and ran == []
    release.set()
    worker.drain()
    assert [i for i, _ in ran] == list(range(50))
    assert {name for _, name in ran} == {"expert-policy"}
    assert not worker.busy
    worker.close()


def test_a_job_that_raises_is_logged_and_the_next_one_runs(caplog):
    worker = PolicyWorker()
    ran = []
    with caplog.at_level(logging.ERROR, logger="elasticmoe.engine.policy_worker"):
        worker.submit(lambda: 1 / 0)
        worker.submit(lambda: ran.append("after"))
        worker.drain()
    assert ran == ["after"]
    assert "a policy job failed" in caplog.text and "ZeroDivisionError" in caplog.text
    worker.close()


def test_close_runs_the_jobs_submitted_before_it_and_later_ones_run_inline():
    worker = PolicyWorker()
    ran: list[str] = []
    release = threading.Event()
    worker.submit(lambda: release.wait(5))
    worker.submit(lambda: ran.append("queued"))
    closer = threading.Thread(target=worker.close)
    closer.start()
    release.set()
    closer.join(5)
    assert not closer.is_alive() and ran == ["queued"]
    worker.submit(lambda: ran.append(threading.current_thread().name))  # the thread is gone: here, now
    assert ran == ["queued", threading.current_thread().name]
    worker.close()  # idempotent
    worker.drain()  # nothing to wait for


def test_jobs_left_by_a_dead_thread_run_on_the_caller_at_drain():
    worker = PolicyWorker()
    worker.close()
    ran = []
    # As if the thread died with jobs queued (an interpreter shutting down kills daemon threads).
    worker._jobs.append(lambda: ran.append("left"))
    worker._submitted += 1
    worker.drain()
    assert ran == ["left"] and not worker.busy


def test_an_interpreter_exits_with_jobs_queued_and_one_running():
    # A daemon thread: a process that ends (the engine never closed) neither hangs on it nor fails.
    script = textwrap.dedent("""
        import time
        from elasticmoe.engine.policy_worker import PolicyWorker
        worker = PolicyWorker()
        worker.submit(lambda: time.sleep(30))
        for _ in range(100):
            worker.submit(lambda: None)
        time.sleep(0.1)
        print("exiting", flush=True)
    """)
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "exiting" and time.monotonic() - started < 30
