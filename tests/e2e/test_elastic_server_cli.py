"""`elasticmoe serve` without `--single`: option validation (fast) and a real run ended by SIGTERM.

The slow test starts the CLI in a subprocess (its own local Ray session and
Serve app), serves one request over HTTP, sends SIGTERM and expects exit 0
with every HMM /dev/shm file freed.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import httpx
import pytest

from elasticmoe.cli import build_parser
from elasticmoe.cli import main as cli_main
from hmm.memory import list_segments
from hmm.memory.shm import DEFAULT_PREFIX


@pytest.mark.parametrize(
    "args,message",
    [
        (["--devices", "2", "--dp", "0"], "--dp: must be >= 1"),
        (["--devices", "2", "--dp", "3"], "--dp: 3 ranks need 3 devices"),
        (["--devices", "0"], "--devices: must be >= 1"),
        (["--max-queued", "0"], "--max-queued: must be >= 1"),
        (["--device-memory-gb", "-1"], "--device-memory-gb: must be > 0"),
    ],
)
def test_bad_values_exit_2_with_the_option_named(tiny_model_dir, capsys, args, message):
    assert cli_main(["serve", "--model", tiny_model_dir, *args]) == 2
    assert message in capsys.readouterr().err


def test_missing_model_dir_exits_2(capsys):
    assert cli_main(["serve", "--model", "/no/such/model", "--devices", "2", "--dp", "2"]) == 2
    assert "--model" in capsys.readouterr().err


def test_help_explains_every_elastic_option():
    text = build_parser()._subparsers._group_actions[0].choices["serve"].format_help()  # type: ignore[union-attr]
    for option in ("--devices", "--dp", "--address", "--max-queued", "--device-memory-gb", "--dtype", "--port"):
        assert option in text, option


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.slow
def test_cli_serves_and_shuts_down_on_sigterm(tiny_model_dir):
    port = _free_port()
    segments_before = set(list_segments(DEFAULT_PREFIX))
    cmd = [
        sys.executable, "-m", "elasticmoe.cli", "--log-level", "WARNING", "serve",
        "--model", tiny_model_dir, "--devices", "2", "--dp", "2", "--port", str(port),
        "--device-memory-gb", "0.0625", "--kv-cache-gb", "0.004", "--served-model-name", "m",
    ]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env={**os.environ})
    try:
        deadline = time.monotonic() + 180
        while True:
            assert proc.poll() is None, proc.stdout.read().decode()  # type: ignore[union-attr]
            assert time.monotonic() < deadline, "server did not come up"
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.5)
        r = httpx.post(f"http://127.0.0.1:{port}/v1/completions",
                       json={"model": "m", "prompt": "x", "max_tokens": 2}, timeout=60)
        assert r.status_code == 200, r.text
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=120) == 0, proc.stdout.read().decode()  # type: ignore[union-attr]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    # Other test sessions on this machine use "emoetest..." prefixes; the CLI uses the default one.
    leaked = set(list_segments(DEFAULT_PREFIX)) - segments_before
    assert not [s for s in leaked if not s.startswith("emoetest")], "shared-memory files leaked"
