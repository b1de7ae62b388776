"""A thread that runs the expert-offloading policy's work beside the forward.

FineMoE (§4.5) searches and prefetches beside the forward; here the policy's searches and plans
(`ExpertOffload`'s jobs: a few hundred microseconds of Python and NumPy per MoE layer) run on this
thread while the forward thread is inside the expert GEMM and the next layer's attention, whose
kernels release the GIL. Jobs run one at a time, in submission order: the policy sees its layers
in order, as on the forward thread.

A job that raises is logged and dropped; the thread goes on with the next. Where the thread is
gone (closed, or an interpreter shutting down), `submit` runs the job on the caller's thread, so
no work is ever lost and nothing waits for a thread that will not come.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable

logger = logging.getLogger(__name__)

Job = Callable[[], None]


class PolicyWorker:
    """One daemon thread running submitted jobs in order."""

    def __init__(self, name: str = "expert-policy") -> None:
        self._jobs: deque[Job] = deque()
        self._submitted = 0  # jobs queued since the start
        self._done = 0  # ... of them run (or failed)
        self._cond = threading.Condition()
        self._closing = False
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def submit(self, job: Job) -> None:
        """Run `job` after the jobs submitted before it (here and now if the thread is gone)."""
        with self._cond:
            if not self._closing and self._thread.is_alive():
                self._jobs.append(job)
                self._submitted += 1
                self._cond.notify_all()
                return
        _run(job)

    def drain(self) -> None:
        """Block until every job submitted before this call has run (not the ones submitted
        meanwhile: another thread may call this while the forward goes on submitting)."""
        with self._cond:
            target = self._submitted
            while self._done < target and self._thread.is_alive():
                self._cond.wait(0.1)
            if self._done >= target:
                return
        self._run_left_here()  # the thread died under its jobs (it catches everything: shutdown)

    def close(self) -> None:
        """Run the jobs submitted so far, then stop the thread. Idempotent."""
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        if self._thread is not threading.current_thread():
            self._thread.join()
        self._run_left_here()

    @property
    def busy(self) -> bool:
        """Jobs are queued or running."""
        with self._cond:
            return self._done < self._submitted

    def _run_left_here(self) -> None:
        """Run the queued jobs on this thread (the worker is gone), outside the condition: a job
        takes the expert cache's lock, and no thread may hold both."""
        with self._cond:
            left, self._jobs = list(self._jobs), deque()
        for job in left:
            _run(job)
        with self._cond:
            self._done += len(left)
            self._cond.notify_all()

    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self._jobs and not self._closing:
                    self._cond.wait()
                if not self._jobs:  # closing, and everything ran
                    return
                job = self._jobs.popleft()
            _run(job)
            with self._cond:
                self._done += 1
                self._cond.notify_all()


def _run(job: Job) -> None:
    try:
        job()
    except Exception:  # noqa: BLE001 - a policy's fault costs prefetching, never the forward
        logger.exception("expert offloading: a policy job failed")
