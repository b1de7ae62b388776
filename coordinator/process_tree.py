"""The driver of a local Ray cluster as a supervisor: what it started ends with it.

`elasticmoe serve` starts Ray's processes; Ray's workers are children of the raylet. If the
raylet dies first (a process group SIGTERMed at once, as systemd does), its workers are
re-parented: to init normally, so nobody would end them. `become_subreaper()` makes this
process their new parent instead, so that at the end of an orderly shutdown
`end_children()` finds whatever is left (Serve's controller and proxy, say) and ends it.
Linux only (`prctl(PR_SET_CHILD_SUBREAPER)`); elsewhere both are no-ops.
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

_PR_SET_CHILD_SUBREAPER = 36


def become_subreaper() -> bool:
    """Orphaned descendants become this process's children (True if the kernel agreed)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def is_alive(pid: int) -> bool:
    """`pid` exists and is not a zombie."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


def child_running(binary: str) -> int | None:
    """The pid of a live child of this process whose command line names `binary` (e.g. Ray's
    `raylet`, which `ray.init` starts as our child)."""
    for pid in _children(os.getpid()):
        try:
            if binary.encode() in Path(f"/proc/{pid}/cmdline").read_bytes() and is_alive(pid):
                return pid
        except OSError:
            continue
    return None


def _children_by_parent() -> dict[int, list[int]]:
    """Parent pid -> the pids of its live children, from one look at /proc (no psutil)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            parent = int(stat.read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(parent, []).append(int(stat.parent.name))
    return children


def _children(pid: int) -> list[int]:
    return _children_by_parent().get(pid, [])


def descendants(*pids: int) -> set[int]:
    """Every live process below `pids`: their children, the children's children, ..."""
    children, out, todo = _children_by_parent(), set(), list(pids)
    while todo:
        for child in children.get(todo.pop(), []):
            if child not in out:
                out.add(child)
                todo.append(child)
    return out


def _is_ray_process(pid: int) -> bool:
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ")
    except OSError:
        return False
    return cmdline.startswith(b"ray::") or b"/ray/" in cmdline


def end_children(grace_s: float = 5.0) -> list[int]:
    """SIGTERM every live child of this process that is one of Ray's (a worker `ray::...` or a
    Ray binary), SIGKILL those alive after `grace_s`, reap them. Returns the pids it ended."""
    children = [p for p in _children(os.getpid()) if is_alive(p) and _is_ray_process(p)]
    _terminate(children, grace_s)
    for pid in children:
        try:
            os.waitpid(pid, 0)
        except ChildProcessError:
            pass
    if children:
        logger.warning("ended %d processes left behind by Ray: %s", len(children), children)
    return children


def end_descendants(grace_s: float = 1.0, reap_s: float = 5.0) -> list[int]:
    """SIGTERM every live Ray process below this one (the raylet's workers too, not only this
    process's children), SIGKILL those alive after `grace_s`, and reap the ones that are (or
    become, as their raylet dies) this process's children, for up to `reap_s`. Returns their pids.
    For a cluster that cannot be shut down in order; `end_children` is the orderly shutdown's."""
    pids = sorted(p for p in descendants(os.getpid()) if is_alive(p) and _is_ray_process(p))
    _terminate(pids, grace_s)
    waiting, deadline = set(pids), time.monotonic() + reap_s
    while waiting and time.monotonic() < deadline:
        for pid in list(waiting):
            try:
                if os.waitpid(pid, os.WNOHANG)[0] == pid:
                    waiting.discard(pid)
            except ChildProcessError:  # not (yet) ours: dead once its zombie is gone from /proc
                if not Path(f"/proc/{pid}").exists():
                    waiting.discard(pid)
        time.sleep(0.05)
    if pids:
        logger.warning("ended %d of Ray's processes: %s", len(pids), pids)
    return pids


def _terminate(pids: list[int], grace_s: float) -> None:
    """SIGTERM `pids`, and SIGKILL those still alive after `grace_s`."""
    for pid in pids:
        _signal(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and any(is_alive(p) for p in pids):
        time.sleep(0.05)
    for pid in pids:
        if is_alive(pid):
            _signal(pid, signal.SIGKILL)


def _signal(pid: int, sig: signal.Signals) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


def call_with_timeout(
    fn: Callable[[], Any], timeout_s: float, what: str, give_up: Callable[[], bool] = lambda: False
) -> bool:
    """Run `fn` on a daemon thread; False if it raised, or did not return within `timeout_s` or
    before `give_up()` turned true (it is then abandoned: shutting down must not hang on a
    half-dead cluster)."""
    errors: list[BaseException] = []

    def run() -> None:
        try:
            fn()
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    thread = threading.Thread(target=run, name=what, daemon=True)
    thread.start()
    t0 = time.monotonic()
    while thread.is_alive() and time.monotonic() - t0 < timeout_s and not give_up():
        thread.join(0.2)
    if thread.is_alive():
        logger.warning("%s: gave up after %.1f s; going on", what, time.monotonic() - t0)
        return False
    if errors:
        logger.warning("%s failed: %r", what, errors[0])
        return False
    return True
