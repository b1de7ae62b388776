"""`descendants`: every live process below the given ones, children's children included."""

from __future__ import annotations

import subprocess
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
