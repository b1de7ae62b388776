"""Run a benchmark's command line as its user would, for the end-to-end bench tests.

A bench that does not finish in time is stopped as a user would stop it (Ctrl-C: it shuts its
servers and its Ray down; SIGKILL only if that hangs too, which would orphan them) and the test
fails with the end of its log, where the stuck step is named, not with a bare timeout.
"""

from __future__ import annotations

import signal
import subprocess

import pytest

STOP_WAIT_S = 60.0  # for the bench's own shutdown after Ctrl-C


def _default_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)  # Python then installs its KeyboardInterrupt


def run_bench(cmd: list[str], timeout_s: float) -> subprocess.CompletedProcess[str]:
    # NOTE: pytest-xdist's workers ignore SIGINT, and a child inherits that: Ctrl-C would do nothing.
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=_default_sigint)
    try:
        out, err = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGINT)
        try:
            out, err = proc.communicate(timeout=STOP_WAIT_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, err = proc.communicate()
        pytest.fail(f"{' '.join(cmd[1:4])} ... did not finish within {timeout_s:.0f} s; its log ends:\n{err[-5000:]}")
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)
