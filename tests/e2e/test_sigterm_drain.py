"""SIGTERM on `elasticmoe serve`: stop accepting (503), finish what is in flight, release, exit.

Each server runs as a real subprocess (the elastic one with its own local Ray). A
long stream is in flight when SIGTERM arrives: it must finish in full, a new request
must get 503 meanwhile, the process must exit 0, and afterwards no process it
started may be alive and (elastic) no shared-memory file of its HMM may remain.
Also SIGTERM to the whole process group at once (systemd's default; Ray's GCS and raylet
go down with the rest): the shutdown ends Ray's processes instead of calling into them, everything
exits within 60 s (what systemd waits before SIGKILL), the server with 0, and no
shared-memory file is left.
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
import ray  # noqa: F401 - makes its vendored psutil importable (`_listens`)

from coordinator.process_tree import descendants
from elasticmoe.engine.async_llm import MIN_STEP_INTERVAL_ENV
from elasticmoe.utils.ports import free_port
from hmm.memory import list_segments

pytestmark = pytest.mark.slow

MODEL = "tiny"
STREAM_TOKENS = 1000


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def _listens(pids: set[int], port: int) -> bool:
    """Whether one of `pids` holds a listening TCP socket on `port`."""
    import psutil  # NOTE: Ray's vendored copy, importable once ray is (imported above)

    for pid in pids:
        try:
            if any(c.status == psutil.CONN_LISTEN and c.laddr.port == port
                   for c in psutil.Process(pid).net_connections("tcp")):
                return True
        except psutil.Error:  # gone meanwhile
            continue
    return False


def _start(args: list[str], timeout_s: float, attempts: int = 3) -> tuple[subprocess.Popen, int]:
    """`elasticmoe serve ARGS` on a free port, ready: (process, port). A port picked free can be
    taken before the server binds it (by the other test worker's server): then the server that
    answers is not ours, and ours starts again on another port."""
    # NOTE: paced (a step at most every 5 ms, so a STREAM_TOKENS stream lasts >= 5 s): at full speed
    # the tiny model's stream could end before the drain began, and the test then proves nothing.
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "ELASTICMOE_API_KEY": "", "ELASTICMOE_ADMIN_KEY": "",
           MIN_STEP_INTERVAL_ENV: "0.005"}
    for _ in range(attempts):
        port = free_port()
        proc = subprocess.Popen([sys.executable, "-m", "elasticmoe.cli", "serve", *args, "--port", str(port),
                                 "--served-model-name", MODEL], env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, start_new_session=True)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/ready", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        else:
            if proc.poll() is None:
                proc.kill()
                raise AssertionError(f"server not ready in {timeout_s} s:\n{proc.stdout.read()[-4000:]}")
            out = proc.stdout.read()
            assert "cannot listen" in out, f"server exited early:\n{out[-4000:]}"
            continue  # the port was taken before it started
        if _listens({proc.pid} | descendants(proc.pid), port):
            return proc, port
        os.killpg(proc.pid, signal.SIGKILL)  # another server answered on that port
        proc.wait()
    raise AssertionError(f"no free port held for the server in {attempts} attempts")


def _drain_on_sigterm(proc: subprocess.Popen, port: int) -> tuple[list[dict], httpx.Response, set[int]]:
    """Start a long stream, SIGTERM once it streams, try a new request; returns (stream events,
    the new request's response, the server's descendants before the signal)."""
    url = f"http://127.0.0.1:{port}"
    events: list[dict] = []
    first = threading.Event()
    errors: list[BaseException] = []

    def stream() -> None:
        # NOTE: long enough to still stream when the drain starts (the elastic server notices the
        # signal within 0.5 s); a stream that ended first would let the server stop under the probes.
        body = {"model": MODEL, "prompt": [5, 6, 7], "max_tokens": STREAM_TOKENS, "ignore_eos": True,
                "stream": True}
        try:
            with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=120) as r:
                assert r.status_code == 200
                for line in r.iter_lines():
                    if line.startswith("data: ") and line != "data: [DONE]":
                        events.append(json.loads(line[6:]))
                        first.set()
                    elif line == "data: [DONE]":
                        events.append({"done": True})
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            errors.append(exc)
            first.set()

    thread = threading.Thread(target=stream)
    thread.start()
    assert first.wait(60), "the stream never started"
    family = descendants(proc.pid)
    proc.send_signal(signal.SIGTERM)
    refused = None
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:  # the signal is handled asynchronously: poll until refused
        refused = httpx.post(f"{url}/v1/completions", json={"model": MODEL, "prompt": [5], "max_tokens": 1},
                             timeout=30)
        if refused.status_code == 503:
            assert thread.is_alive(), "the stream ended before the drain began: it proves nothing"
            break
        time.sleep(0.05)
    thread.join(120)
    assert not errors, errors
    return events, refused, family


def _check_exit(proc: subprocess.Popen, family: set[int], timeout_s: float) -> str:
    try:
        out, _ = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        raise AssertionError("server did not exit after SIGTERM") from None
    assert proc.returncode == 0, out[-4000:]
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and any(_alive(p) for p in family):
        time.sleep(0.5)
    left = sorted(p for p in family if _alive(p))
    if left:
        os.killpg(proc.pid, signal.SIGKILL)
    assert not left, f"processes left behind: {left}"
    return out


def _check_stream(events: list[dict], refused: httpx.Response) -> None:
    assert events[-1] == {"done": True}
    assert events[-2]["choices"][0]["finish_reason"] == "length"  # all STREAM_TOKENS, not cut off
    assert refused is not None and refused.status_code == 503, refused and refused.text
    assert refused.json()["error"]["code"] == 503 and refused.headers["retry-after"] == "1"


def test_single_server_drains_on_sigterm(tiny_model_dir):
    proc, port = _start(["--single", "--model", tiny_model_dir, "--shutdown-timeout", "60"], 120)
    events, refused, family = _drain_on_sigterm(proc, port)
    _check_stream(events, refused)
    out = _check_exit(proc, family, 60)
    assert "drain finished" in out and "'drained': True" in out


def _start_elastic(model_dir: str) -> tuple[subprocess.Popen, int, str]:
    """`elasticmoe serve` (2 devices, dp 1, no standby pool) as a subprocess: (process, port, shm prefix)."""
    prefix = f"emoesig{secrets.token_hex(4)}"
    proc, port = _start(["--model", model_dir, "--devices", "2", "--dp", "1", "--device-memory-gb", "0.0625",
                         "--kv-cache-gb", "0.004", "--no-standby-pool", "--shm-prefix", prefix,
                         "--shutdown-timeout", "60"], 240)
    return proc, port, prefix


def test_elastic_server_drains_on_sigterm_and_releases_everything(tiny_model_dir):
    proc, port, prefix = _start_elastic(tiny_model_dir)
    try:
        assert list_segments(prefix), "the HMM made no shared-memory files (wrong prefix?)"
        events, refused, family = _drain_on_sigterm(proc, port)
        assert len(family) > 3  # Ray's processes, the coordinator replica, device workers, ranks
        _check_stream(events, refused)
        out = _check_exit(proc, family, 180)
        assert "'drained': True" in out
        assert "ending Ray's processes" not in out  # only the server was signalled: Ray ends in order
        assert list_segments(prefix) == [], "shared-memory files left behind"
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)


def test_elastic_server_exits_cleanly_when_its_whole_process_group_is_sigtermed(tiny_model_dir):
    proc, _, prefix = _start_elastic(tiny_model_dir)
    try:
        assert list_segments(prefix), "the HMM made no shared-memory files (wrong prefix?)"
        # NOTE: /ready answers before the server process has finished starting (Serve's deploy call
        # returns after it); a signal then is served by the collapse watchdog, not the shutdown
        # this test is about. So the signal waits for the process's own "ready" line.
        lines: list[str] = []
        started = threading.Event()

        def read() -> None:  # NOTE: reads its output throughout (a full pipe would block it)
            for line in proc.stdout:
                lines.append(line)
                if "elastic server ready" in line:
                    started.set()

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        assert started.wait(60), "".join(lines)[-3000:]
        family = descendants(proc.pid)
        t0 = time.monotonic()
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            pass
        reader.join(10)
        out = "".join(lines)
        while time.monotonic() - t0 < 60 and any(_alive(p) for p in family):
            time.sleep(0.2)
        left = sorted(p for p in family if _alive(p))
        assert proc.poll() == 0 and not left, f"after 60 s: server {proc.poll()}, left {left}:\n{out[-3000:]}"
        # the shutdown found Ray's GCS silent and ended Ray's processes (not ~10 s of calls into them
        # while the raylet's own shutdown waits on the GCS, nor the collapse watchdog after that)
        assert "ending Ray's processes" in out and "shutdown is stuck" not in out, out[-3000:]
        assert list_segments(prefix) == [], "shared-memory files left behind"
    finally:
        if proc.poll() is None or any(_alive(p) for p in descendants(proc.pid)):
            os.killpg(proc.pid, signal.SIGKILL)
