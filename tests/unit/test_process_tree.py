"""`descendants`: every live process below the given ones, children's children included;
`end_descendants`: Ray's processes among them ended and reaped."""

from __future__ import annotations

import json
import subprocess
import sys
import time

from coordinator.process_tree import descendants


def test_descendants_reach_the_grandchildren_and_nothing_else():
    # sh -> (sleep, sh -> sleep): three processes on two levels below the shell we start
    proc = subprocess.Popen(["sh", "-c", "sleep 30 & sh -c 'sleep 30 & wait' & wait"])
    try:
        deadline = time.monotonic() + 10
        while len(found := descendants(proc.pid)) < 3 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(found) == 3 and proc.pid not in found, found
        assert len(descendants(*found)) == 1  # below the leaves nothing, below the inner shell its sleep
    finally:
        for pid in [proc.pid, *descendants(proc.pid)]:
            subprocess.run(["kill", "-9", str(pid)], check=False)
        proc.wait()


# A stand-in for a collapsing Ray node, below a subreaper: a "raylet" and its "worker" child, both
# ignoring SIGTERM (as Ray's processes in their own shutdown do), and a process that is not Ray's.
_END_DESCENDANTS = r"""
import json, os, subprocess, sys, time
from coordinator.process_tree import become_subreaper, descendants, end_descendants, is_alive
assert become_subreaper()
other = subprocess.Popen(["sleep", "60"])
node = subprocess.Popen(["bash", "-c", "trap '' TERM; (exec -a ray::worker sleep 60) & exec -a ray::raylet sleep 60"])
def rays():  # the stand-ins once both have exec'd into their names
    out = []
    for pid in descendants(os.getpid()):
        try:
            out += [pid] if open(f"/proc/{pid}/cmdline", "rb").read().startswith(b"ray::") else []
        except OSError:
            pass
    return out
deadline = time.monotonic() + 10
while len(rays()) < 2 and time.monotonic() < deadline:
    time.sleep(0.05)
worker = sorted(descendants(node.pid))
ended = end_descendants(grace_s=0.3, reap_s=5)
print(json.dumps({"ended": ended, "node": node.pid, "worker": worker, "other_alive": is_alive(other.pid),
                  "left": sorted(p for p in [node.pid, *worker] if os.path.exists(f"/proc/{p}"))}))
other.kill()
other.wait()
"""


def test_end_descendants_ends_rays_processes_below_and_reaps_them():
    out = subprocess.run([sys.executable, "-c", _END_DESCENDANTS], capture_output=True, text=True, timeout=60,
                         check=True)
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert len(result["worker"]) == 1, result  # the raylet stand-in's child, one level further down
    assert result["ended"] == sorted([result["node"], *result["worker"]]), result  # SIGTERM ignored: SIGKILL
    assert result["left"] == [], result  # both reaped (the worker once it was re-parented to the subreaper)
    assert result["other_alive"], "a process that is not Ray's was ended"
