"""`elasticmoe serve` without `--single`: option validation (and, for both servers, an address in
use refused before anything loads; an address taken after that check fails the start without a
file left in /dev/shm). Real runs of the CLI ended by SIGTERM are in `test_sigterm_drain.py` (a
local Ray) and `test_elastic_scale.py` (two Ray nodes)."""

from __future__ import annotations

import socket
import time

import pytest
import ray
from elastic_server import RAY, tiny_config

from coordinator.launch import start_elastic
from elasticmoe.cli import build_parser
from elasticmoe.cli import main as cli_main
from hmm.memory import list_segments


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


@pytest.mark.parametrize("mode", [["--devices", "2", "--dp", "1"], ["--single"]], ids=["elastic", "single"])
def test_a_port_in_use_exits_2_naming_the_address_before_anything_loads(tiny_model_dir, capsys, mode):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        t0 = time.monotonic()
        assert cli_main(["serve", "--model", tiny_model_dir, "--host", "127.0.0.1", "--port", str(port), *mode]) == 2
        assert time.monotonic() - t0 < 10  # NOTE: a bound, not a speed check: no Ray, no model load
    assert f"--host/--port: cannot listen on 127.0.0.1:{port}" in capsys.readouterr().err


@pytest.mark.slow  # a whole server start, to fail at its last step
def test_a_start_whose_ingress_cannot_listen_frees_the_devices_it_started(tiny_model_dir, monkeypatch):
    """The port is taken after the CLI's check (a race): the coordinator has put the model on its
    devices when the ingress fails to bind. The start raises, and neither Ray nor a /dev/shm file
    of the server is left."""
    # Serve starts a failing replica three times before it gives up; once shows the same cleanup,
    # ~7 s sooner (the variable reaches Serve's controller through the Ray this start begins).
    monkeypatch.setenv("RAY_SERVE_MAX_PER_REPLICA_RETRY_COUNT", "1")
    config = tiny_config(tiny_model_dir)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        with pytest.raises(RuntimeError, match="ingress"):
            start_elastic(config, port=taken.getsockname()[1], ray_init_kwargs=RAY)
    assert not ray.is_initialized()
    assert list_segments(config.shm_prefix) == []
