"""The single-process OpenAI server over the real engine and the tiny Qwen3-MoE checkpoint.

One uvicorn server per module, on a free localhost port, driven by a real HTTP
client (so streaming and client disconnects behave as they do in production).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field

import httpx
import pytest
import torch
import uvicorn

from elasticmoe.cli import main as cli_main
from elasticmoe.config import EngineConfig
from elasticmoe.engine.async_llm import AsyncLLM
from elasticmoe.engine.llm_engine import LLMEngine
from elasticmoe.entrypoints.openai.api_server import build_app

MODEL = "tiny-qwen3-moe"
LONG = {"max_tokens": 1500, "ignore_eos": True}  # seconds of decoding: long enough to disconnect midway


@dataclass
class Server:
    url: str
    async_llm: AsyncLLM
    aborted_ids: list[str] = field(default_factory=list)

    @property
    def engine(self) -> LLMEngine:
        return self.async_llm.engine  # type: ignore[return-value]

    def client(self, **kwargs) -> httpx.Client:
        return httpx.Client(base_url=self.url, timeout=kwargs.pop("timeout", 60), **kwargs)

    def wait_idle(self, timeout_s: float = 10.0) -> None:
        deadline = time.monotonic() + timeout_s
        while self.engine.has_unfinished_requests() or self.async_llm._streams:
            assert time.monotonic() < deadline, "engine still has requests"
            time.sleep(0.02)


def _free_socket() -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    return sock


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    engine = LLMEngine(EngineConfig(model=tiny_model_dir, dtype=torch.float32, kv_cache_bytes=8 << 20))
    async_llm = AsyncLLM(engine)
    srv = Server("", async_llm)
    real_abort = engine.abort

    def recording_abort(request_id: str) -> None:  # a spy; the real abort still runs
        srv.aborted_ids.append(request_id)
        real_abort(request_id)

    engine.abort = recording_abort  # type: ignore[method-assign]
    async_llm.start()
    sock = _free_socket()
    uv = uvicorn.Server(uvicorn.Config(build_app(async_llm, MODEL), log_level="warning"))
    thread = threading.Thread(target=uv.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not uv.started:
        assert time.monotonic() < deadline and thread.is_alive(), "uvicorn did not start"
        time.sleep(0.02)
    srv.url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    yield srv
    uv.should_exit = True
    thread.join(15)
    async_llm.shutdown()
    sock.close()


def _sse(response: httpx.Response) -> list[dict]:
    """Parse a finished SSE body; asserts the framing and the closing [DONE]."""
    events = [e for e in response.text.split("\n\n") if e]
    assert events and events[-1] == "data: [DONE]"
    assert all(e.startswith("data: ") for e in events)
    return [json.loads(e[len("data: ") :]) for e in events[:-1]]


def _post(server: Server, path: str, body: dict) -> httpx.Response:
    with server.client() as c:
        return c.post(path, json={"model": MODEL, **body})


CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is an expert?"}]


def test_completion(server):
    prompt = "the expert model serves"
    r = _post(server, "/v1/completions", {"prompt": prompt, "max_tokens": 8, "temperature": 0})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["id"].startswith("cmpl-") and body["object"] == "text_completion" and body["model"] == MODEL
    choice = body["choices"][0]
    assert isinstance(choice["text"], str) and choice["finish_reason"] in ("stop", "length")
    usage = body["usage"]
    assert usage["prompt_tokens"] == len(server.engine.tokenizer.encode(prompt))
    assert 1 <= usage["completion_tokens"] <= 8
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    if choice["finish_reason"] == "length":
        assert usage["completion_tokens"] == 8


def test_chat_completion(server):
    r = _post(
        server, "/v1/chat/completions", {"messages": CHAT, "max_completion_tokens": 6, "temperature": 0}
    )
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["id"].startswith("chatcmpl-") and body["object"] == "chat.completion"
    message = body["choices"][0]["message"]
    assert message["role"] == "assistant" and isinstance(message["content"], str)
    expected_prompt = server.engine.tokenizer.apply_chat_template(CHAT)
    assert body["usage"]["prompt_tokens"] == len(expected_prompt)
    assert 1 <= body["usage"]["completion_tokens"] <= 6


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_stream_equals_greedy_non_stream(server, path):
    base = {"max_tokens": 12, "temperature": 0, "ignore_eos": True}
    base.update({"messages": CHAT} if "chat" in path else {"prompt": "elastic scale of the router"})
    full = _post(server, path, base).json()
    r = _post(server, path, {**base, "stream": True, "stream_options": {"include_usage": True}})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    chunks = _sse(r)
    assert len({c["id"] for c in chunks}) == 1
    usage_chunk, chunks = chunks[-1], chunks[:-1]
    assert usage_chunk["choices"] == []
    # the same counts; the second request found the first one's full prompt blocks in the prefix cache
    cached = usage_chunk["usage"].pop("prompt_tokens_details")["cached_tokens"]
    assert usage_chunk["usage"] == {k: v for k, v in full["usage"].items() if k != "prompt_tokens_details"}
    assert cached == (full["usage"]["prompt_tokens"] - 1) // 16 * 16
    if "chat" in path:
        assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
        text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
        expected = full["choices"][0]["message"]["content"]
    else:
        text = "".join(c["choices"][0]["text"] for c in chunks)
        expected = full["choices"][0]["text"]
    assert text == expected
    assert chunks[-1]["choices"][0]["finish_reason"] == "length" == full["choices"][0]["finish_reason"]
    assert all(c["choices"][0]["finish_reason"] is None for c in chunks[:-1])
    # a chunk per token (the random model's byte tokens often hold their text back: empty chunks),
    # the last token's text riding on the finish chunk or just before it
    per_token = chunks[1:-1] if "chat" in path else chunks[:-1]
    assert 11 <= len(per_token) <= 12


def test_logprobs(server):
    r = _post(
        server, "/v1/completions", {"prompt": "the cache", "max_tokens": 5, "temperature": 0, "logprobs": 3}
    )
    body = r.json()
    lp = body["choices"][0]["logprobs"]
    n = body["usage"]["completion_tokens"]
    assert (
        len(lp["tokens"])
        == len(lp["token_logprobs"])
        == len(lp["top_logprobs"])
        == len(lp["text_offset"])
        == n
    )
    for token, logprob, top in zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"], strict=True):
        assert logprob <= 0 and token in top and 3 <= len(top) <= 4
        assert logprob >= max(top.values()) - 1e-4  # greedy picks the most likely token

    r = _post(
        server,
        "/v1/chat/completions",
        {"messages": CHAT, "max_tokens": 4, "temperature": 0, "logprobs": True, "top_logprobs": 2},
    )
    body = r.json()
    content = body["choices"][0]["logprobs"]["content"]
    assert len(content) == body["usage"]["completion_tokens"]
    for entry in content:
        assert len(entry["top_logprobs"]) == 2 and entry["logprob"] <= 0
        assert entry["bytes"] == list(entry["token"].encode())


def test_models_health_ready_metrics(server):
    with server.client() as c:
        models = c.get("/v1/models").json()
        assert models["object"] == "list"
        assert [m["id"] for m in models["data"]] == [MODEL]
        assert models["data"][0]["max_model_len"] == server.engine.max_model_len
        assert c.get("/health").status_code == 200
        assert c.get("/ready").status_code == 200
        metrics = c.get("/metrics")
    assert metrics.status_code == 200
    text = metrics.text
    assert 'elasticmoe_http_requests_total{endpoint="/v1/completions",status="200"}' in text
    assert "elasticmoe_time_to_first_token_seconds_count" in text
    assert "elasticmoe_e2e_request_latency_seconds_count" in text


@pytest.mark.parametrize(
    "path,body,status,param",
    [
        ("/v1/completions", {"prompt": "x", "temperature": -1}, 400, "temperature"),
        ("/v1/completions", {"prompt": "expert " * 3000}, 400, "prompt"),
        ("/v1/completions", {"prompt": "x", "max_tokens": 100000}, 400, "max_tokens"),
        ("/v1/completions", {"prompt": "x", "n": 17}, 400, "n"),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "expert " * 3000}]},
            400,
            "messages",
        ),
        ("/v1/completions", {"model": "no-such-model", "prompt": "x"}, 404, "model"),
    ],
)
def test_bad_input_is_rejected_and_engine_keeps_serving(server, path, body, status, param):
    r = _post(server, path, body)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["param"] == param and error["message"] and error["type"]
    ok = _post(server, "/v1/completions", {"prompt": "x", "max_tokens": 2})
    assert ok.status_code == 200
    server.wait_idle()


def test_malformed_json_is_400(server):
    with server.client() as c:
        r = c.post(
            "/v1/chat/completions",
            content=b'{"model": "x", "messages": [',
            headers={"content-type": "application/json"},
        )
    assert r.status_code == 400 and r.json()["error"]["type"] == "BadRequestError"
    assert _post(server, "/v1/completions", {"prompt": "x", "max_tokens": 2}).status_code == 200


def test_disconnect_mid_stream_aborts_the_request(server):
    body = {"model": MODEL, "prompt": "the stream", "stream": True, **LONG}
    with server.client() as c, c.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        first = next(line for line in lines if line.startswith("data: "))
        request_id = json.loads(first[len("data: ") :])["id"]
    # The connection is closed with ~1500 tokens still to go.
    server.wait_idle()
    assert request_id in server.aborted_ids


def test_disconnect_mid_stream_aborts_every_choice(server):
    body = {"model": MODEL, "prompt": "the stream", "stream": True, "n": 3, **LONG}
    before = len(server.aborted_ids)
    with server.client() as c, c.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200
        seen: set[int] = set()
        for line in r.iter_lines():
            if line.startswith("data: {"):
                chunk = json.loads(line[len("data: ") :])
                seen.add(chunk["choices"][0]["index"])
            if seen == {0, 1, 2}:
                break
    # The connection is closed with ~1500 tokens per choice still to go.
    server.wait_idle()
    request_id = chunk["id"]
    assert sorted(server.aborted_ids[before:]) == [f"{request_id}-{i}" for i in range(3)]


def test_disconnect_while_waiting_non_streaming_aborts_the_request(server):
    before = len(server.aborted_ids)
    with server.client(timeout=0.5) as c, pytest.raises(httpx.ReadTimeout):
        c.post("/v1/completions", json={"model": MODEL, "prompt": "the wait", **LONG})
    server.wait_idle()
    assert len(server.aborted_ids) == before + 1


def test_serve_rejects_a_missing_model_dir(capsys):
    assert cli_main(["serve", "--single", "--model", "/nonexistent/model"]) == 2
    assert "/nonexistent/model" in capsys.readouterr().err


@pytest.mark.slow
def test_cli_serve_shuts_down_cleanly_on_sigterm(tiny_model_dir):
    sock = _free_socket()
    port = sock.getsockname()[1]
    sock.close()
    cmd = [
        sys.executable,
        "-m",
        "elasticmoe.cli",
        "--log-level",
        "WARNING",
        "serve",
        "--single",
        "--model",
        tiny_model_dir,
        "--port",
        str(port),
        "--kv-cache-gb",
        "0.01",
        "--served-model-name",
        MODEL,
    ]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env={**os.environ})
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, proc.stdout.read().decode()
            assert time.monotonic() < deadline, "server did not come up"
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        r = httpx.post(
            f"http://127.0.0.1:{port}/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 2}
        )
        assert r.status_code == 200
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0, proc.stdout.read().decode()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
