"""The load generator end to end: `python -m coordinator.bench.load` against the single-process
server on the tiny model (uvicorn in a thread of the test process, one per module), against a
closed port, and with bad arguments."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import threading
import time

import pytest
import torch
import uvicorn

from elasticmoe.config import EngineConfig
from elasticmoe.engine.async_llm import AsyncLLM
from elasticmoe.engine.llm_engine import LLMEngine
from elasticmoe.entrypoints.openai.api_server import build_app

MODEL = "tiny-qwen3-moe"
REQUEST_FIELDS = {"request_id", "model", "arrival_s", "first_token_s", "finished_s", "ttft_s", "tpot_s",
                  "prompt_len", "max_tokens", "num_tokens", "status", "ok", "error"}


@pytest.fixture(scope="module")
def server_url(tiny_model_dir):
    async_llm = AsyncLLM(LLMEngine(EngineConfig(model=tiny_model_dir, dtype=torch.float32, kv_cache_bytes=8 << 20)))
    async_llm.start()
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    uv = uvicorn.Server(uvicorn.Config(build_app(async_llm, MODEL), log_level="warning"))
    thread = threading.Thread(target=uv.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not uv.started:
        assert time.monotonic() < deadline and thread.is_alive(), "uvicorn did not start"
        time.sleep(0.02)
    yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    uv.should_exit = True
    thread.join(15)
    async_llm.shutdown()
    sock.close()


def run_cli(*args: str, timeout_s: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "coordinator.bench.load", *args], capture_output=True, text=True,
                          timeout=timeout_s)


def test_poisson_run_writes_report_and_plots(server_url, tmp_path):
    out, plot = tmp_path / "load.json", tmp_path / "load.png"
    proc = run_cli("--url", server_url, "--pattern", "poisson", "--rps", "3", "--duration", "4", "--seed", "1",
                   "--prompt-len", "uniform:4:12", "--output-len", "fixed:4", "--slo-ttft", "5", "--slo-tpot", "1",
                   "--json", str(out), "--plot", str(plot))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "requests" in proc.stderr and "TTFT" in proc.stderr  # the summary (no progress bar: not a TTY)
    doc = json.loads(out.read_text())
    assert doc["config"]["pattern"] == "poisson" and doc["config"]["models"] == {MODEL: 1.0}
    rows, s = doc["requests"], doc["summary"]
    assert len(rows) == s["num_requests"] >= 4
    for r in rows:
        assert set(r) == REQUEST_FIELDS
        assert r["ok"] and r["status"] == 200 and r["error"] is None and r["model"] == MODEL, r
        assert 0 <= r["arrival_s"] < 4 and r["arrival_s"] < r["first_token_s"] <= r["finished_s"]
        assert r["num_tokens"] == r["max_tokens"] == 4 and 4 <= r["prompt_len"] <= 12 and r["ttft_s"] > 0
    assert s["num_failed"] == 0 and s["num_ok"] == len(rows) and s["errors"] == {}
    for key in ("ttft_s", "tpot_s"):
        assert 0 < s[key]["p50"] <= s[key]["p90"] <= s[key]["p99"]
    assert s["offered_rps"] == pytest.approx(len(rows) / 4) and s["completed_rps"] > 0 and s["output_tok_s"] > 0
    assert s["slo"] == {"ttft_s": 5.0, "tpot_s": 1.0, "num_attained": len(rows), "attainment": 1.0}
    assert len(doc["timeline"]) == 4 and sum(b["num_requests"] for b in doc["timeline"]) == len(rows)
    assert doc["scale_events"] is None  # a single server has no /admin/status
    for png in (plot, tmp_path / "load-cdf.png"):
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", png
    # Same seed, same schedule: the arrival times are reproduced exactly.
    again = run_cli("--url", server_url, "--rps", "3", "--duration", "4", "--seed", "1", "--prompt-len", "uniform:4:12",
                    "--output-len", "fixed:4", "--json", "-", "--quiet")
    assert again.returncode == 0 and again.stderr == "", again.stderr[-3000:]
    assert [r["arrival_s"] for r in json.loads(again.stdout)["requests"]] == [r["arrival_s"] for r in rows]


def test_adapter_mix_sets_each_requests_model(server_url, tmp_path):
    proc = run_cli("--url", server_url, "--pattern", "constant", "--rps", "4", "--duration", "2",
                   "--adapters", f"{MODEL},no-such-adapter", "--adapter-weights", "1,1", "--prompt-len", "6",
                   "--output-len", "2", "--json", "-", "--quiet")
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = json.loads(proc.stdout)
    rows = doc["requests"]
    assert [r["arrival_s"] for r in rows] == [i / 4 for i in range(8)]
    assert {r["model"] for r in rows} == {MODEL, "no-such-adapter"}
    for r in rows:  # the unknown adapter is refused by the server, the base model serves
        assert r["ok"] == (r["model"] == MODEL), r
        assert r["ok"] or (r["status"] in (400, 404) and r["error"])
    by_model = doc["summary"]["by_model"]
    assert by_model["no-such-adapter"]["num_failed"] == by_model["no-such-adapter"]["num_requests"]


def test_closed_port_reports_failed_requests(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed once the block ends: nothing listens there
    plot = tmp_path / "down.png"
    proc = run_cli("--url", f"http://127.0.0.1:{port}", "--model", "m", "--pattern", "constant", "--rps", "4",
                   "--duration", "1.5", "--timeout", "5", "--json", "-", "--plot", str(plot))
    assert proc.returncode == 0, proc.stderr[-3000:]
    s = json.loads(proc.stdout)["summary"]
    assert s["num_requests"] == s["num_failed"] == 6 and s["num_ok"] == 0
    assert any("ConnectError" in e for e in s["errors"]) and s["ttft_s"]["p50"] is None
    assert plot.exists() and (tmp_path / "down-cdf.png").exists()  # empty plots rather than a crash


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--prompt-len", "uniform:64:16"], "--prompt-len"),
        (["--output-len", "weird:3"], "--output-len"),
        (["--pattern", "bursty"], "--rps-on"),
        (["--pattern", "ramp", "--ramp-points", "0:1,0:2"], "--ramp-points"),
        (["--rps", "-2"], "--rps"),
        (["--adapters", "a,b", "--adapter-weights", "1"], "--adapters"),
        (["--pattern", "csv", "--csv", "BADCSV"], "line 3"),
    ],
)
def test_bad_arguments_exit_2_naming_the_option(tmp_path, args, message):
    bad_csv = tmp_path / "rates.csv"
    bad_csv.write_text("rps\n1\nlots\n")
    proc = run_cli("--url", "http://127.0.0.1:9", *[str(bad_csv) if a == "BADCSV" else a for a in args], timeout_s=30)
    assert proc.returncode == 2, proc.stderr
    assert message in proc.stderr and proc.stdout == ""
