"""Run a benchmark's command line as its user would, for the end-to-end bench tests.

A bench that does not finish in time is stopped as a user would stop it (Ctrl-C: it shuts its
servers and its Ray down; SIGKILL only if that hangs too, which would orphan them) and the test
fails with the end of its log, where the stuck step is named, not with a bare timeout.
"""

from __future__ import annotations

import signal
import subprocess
import sys

import pytest

STOP_WAIT_S = 60.0  # for the bench's own shutdown after Ctrl-C


# Runs the bench with SIGINT's default disposition, which Python turns into KeyboardInterrupt:
# pytest-xdist's workers (and CI's background jobs) ignore SIGINT, and a child inherits that, so
# Ctrl-C would do nothing. (An exec, not a `preexec_fn`, which is unsafe beside threads.)
_WITH_SIGINT = "import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_DFL); os.execv(sys.argv[1], sys.argv[1:])"


def run_bench(cmd: list[str], timeout_s: float) -> subprocess.CompletedProcess[str]:
    proc = subprocess.Popen([sys.executable, "-c", _WITH_SIGINT, *cmd], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
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
