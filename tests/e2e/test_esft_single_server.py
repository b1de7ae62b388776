"""ESFT adapters over HTTP on the single-process server (tiny Qwen3-MoE, 2 slots of 2 experts).

Load at run time with `POST /admin/adapters`, select with `model`, list in `/v1/models`;
outputs equal the merged model's; an adapter beyond the slots is registered on disk and
swapped in when a request needs it (its output equals its merged model's too); errors in
OpenAI format (400 naming the field, 404, 409 naming the conflict); `DELETE` while one of its
requests streams: new requests get 404, the stream completes unchanged, then the slot is free
for another adapter.
"""

from __future__ import annotations

import contextlib
import json
import socket
import threading
import time
from collections.abc import Iterator

import httpx
import pytest
import torch
import uvicorn

from elasticmoe.config import EngineConfig
from elasticmoe.engine.async_llm import AsyncLLM
from elasticmoe.engine.llm_engine import LLMEngine
from elasticmoe.entrypoints.openai.api_server import build_app
from elasticmoe.entrypoints.openai.choices import ADAPTER_STATE_HEADER
from elasticmoe.sampling_params import SamplingParams
from elasticmoe.tools.make_esft_adapter import make_esft_adapter, write_merged_model

MODEL = "tiny-base"
PROMPT = [5, 6, 7, 8, 9, 10]


@pytest.fixture(scope="module")
def adapters(tiny_model_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("esft-http")
    out = {}
    for seed, name in enumerate(("alpha", "beta", "gamma"), start=1):
        path = make_esft_adapter(tiny_model_dir, str(root / name), experts_per_layer=2, seed=seed, noise=0.5)
        out[name] = (str(path), str(write_merged_model(tiny_model_dir, path, str(root / f"{name}-merged"))))
    return out


@contextlib.contextmanager
def _serving(engine: LLMEngine) -> Iterator[str]:
    """The single-process server over `engine` on a free localhost port; yields its URL."""
    async_llm = AsyncLLM(engine)
    async_llm.start()
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    uv = uvicorn.Server(uvicorn.Config(build_app(async_llm, MODEL), log_level="warning"))
    thread = threading.Thread(target=uv.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 30
        while not uv.started:
            assert time.monotonic() < deadline and thread.is_alive()
            time.sleep(0.02)
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        uv.should_exit = True
        thread.join(15)
        async_llm.shutdown()
        sock.close()


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    with _serving(LLMEngine(EngineConfig(model=tiny_model_dir, dtype=torch.float32, kv_cache_bytes=8 << 20,
                                         max_esft_adapters=2, max_esft_experts=2))) as url:
        yield url


def _reference_text(model_dir: str, max_tokens: int) -> str:
    engine = LLMEngine(EngineConfig(model=model_dir, dtype=torch.float32, num_kv_blocks=64))
    engine.add_request("ref", PROMPT, SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))
    while engine.has_unfinished_requests():
        outs = [o for o in engine.step() if o.finished]
    return outs[0].text


def _complete(c: httpx.Client, model: str, max_tokens: int = 8) -> httpx.Response:
    return c.post("/v1/completions", json={"model": model, "prompt": PROMPT, "max_tokens": max_tokens,
                                           "temperature": 0, "ignore_eos": True})


def test_load_select_list_and_errors(server, adapters, tiny_model_dir):
    with httpx.Client(base_url=server, timeout=60) as c:
        r = c.post("/admin/adapters", json={"name": "alpha", "path": adapters["alpha"][0]})
        assert r.status_code == 201, r.text
        assert r.json()["state"] == "loaded" and r.json()["slot"] == 0
        ids = [m["id"] for m in c.get("/v1/models").json()["data"]]
        assert ids == [MODEL, "alpha"]
        card = c.get("/v1/models").json()["data"][1]
        assert card["parent"] == MODEL and card["adapter_type"] == "esft"

        got = _complete(c, "alpha")
        assert got.status_code == 200, got.text
        assert got.json()["model"] == "alpha"
        assert got.headers[ADAPTER_STATE_HEADER] == "resident"  # in its slot on arrival
        assert got.json()["choices"][0]["text"] == _reference_text(adapters["alpha"][1], 8)
        base = _complete(c, MODEL)
        assert base.json()["choices"][0]["text"] == _reference_text(tiny_model_dir, 8)
        assert ADAPTER_STATE_HEADER not in base.headers  # no adapter, no state

        cases = [
            ({"name": "bad name!", "path": adapters["beta"][0]}, 400, "name"),
            ({"name": "beta", "path": "/nonexistent/adapter"}, 400, "path"),
            ({"name": "beta", "path": tiny_model_dir}, 400, "path"),  # a model, not an adapter
            ({"name": MODEL, "path": adapters["beta"][0]}, 409, "name"),
            ({"name": "alpha", "path": adapters["beta"][0]}, 409, "name"),
            ({"name": "beta"}, 400, "path"),
        ]
        for body, status, param in cases:
            r = c.post("/admin/adapters", json=body)
            assert r.status_code == status, (body, r.text)
            assert r.json()["error"]["param"] == param, (body, r.json())
        assert c.post("/admin/adapters", json={"name": "beta", "path": adapters["beta"][0]}).status_code == 201
        # beyond the 2 slots: registered on disk, swapped in when a request needs it
        beyond = c.post("/admin/adapters", json={"name": "gamma", "path": adapters["gamma"][0]})
        assert beyond.status_code == 201 and beyond.json()["slot"] is None, beyond.text
        listed = {a["name"]: a for a in c.get("/admin/adapters").json()["adapters"]}
        assert [listed[n]["resident"] for n in ("alpha", "beta", "gamma")] == [True, True, False]
        got = _complete(c, "gamma")
        assert got.status_code == 200 and got.json()["choices"][0]["text"] == _reference_text(adapters["gamma"][1], 8)
        assert got.headers[ADAPTER_STATE_HEADER] == "swapped"  # it waited for gamma's swap-in
        with c.stream("POST", "/v1/completions", json={"model": "gamma", "prompt": PROMPT, "max_tokens": 2,
                                                       "stream": True}) as streamed:
            assert streamed.headers[ADAPTER_STATE_HEADER] == "resident"  # a stream says it before its events
            streamed.read()
        metrics = c.get("/metrics").text
        ttft = "elasticmoe_adapter_time_to_first_token_seconds_count"
        assert f'{ttft}{{endpoint="completions",state="swapped"}} 1.0' in metrics
        assert f'{ttft}{{endpoint="completions",state="resident"}} 2.0' in metrics
        assert _complete(c, "alpha").json()["choices"][0]["text"] == _reference_text(adapters["alpha"][1], 8)
        listed = {a["name"]: a for a in c.get("/admin/adapters").json()["adapters"]}
        assert sum(a["resident"] for a in listed.values()) == 2  # swapped, never over the slots
        assert c.delete("/admin/adapters/gamma").status_code == 200
        assert _complete(c, "gamma").status_code == 404
        assert c.delete("/admin/adapters/gamma").status_code == 404
        assert {a["name"] for a in c.get("/admin/adapters").json()["adapters"]} == {"alpha", "beta"}
        assert c.get("/health").status_code == 200


def test_unload_waits_for_its_stream_then_frees_the_slot(server, adapters):
    with httpx.Client(base_url=server, timeout=120) as c:
        if "beta" not in [a["name"] for a in c.get("/admin/adapters").json()["adapters"]]:
            assert c.post("/admin/adapters", json={"name": "beta", "path": adapters["beta"][0]}).status_code == 201
        body = {"model": "beta", "prompt": PROMPT, "max_tokens": 300, "temperature": 0, "ignore_eos": True,
                "stream": True}
        text: list[str] = []
        with c.stream("POST", "/v1/completions", json=body) as stream:
            lines = stream.iter_lines()
            first = next(line for line in lines if line.startswith("data: "))
            text += [ch["text"] for ch in json.loads(first[6:])["choices"]]
            r = c.delete("/admin/adapters/beta")
            assert r.status_code == 202 and r.json()["state"] == "unloading"
            assert _complete(c, "beta").status_code == 404  # no new requests for it
            assert "beta" not in [m["id"] for m in c.get("/v1/models").json()["data"]]
            for line in lines:
                if line.startswith("data: ") and line != "data: [DONE]":
                    chunk = json.loads(line[6:])
                    assert "error" not in chunk
                    text += [ch["text"] for ch in chunk["choices"]]
        assert "".join(text) == _reference_text(adapters["beta"][1], 300)
        deadline = time.monotonic() + 10
        while "beta" in [a["name"] for a in c.get("/admin/adapters").json()["adapters"]]:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        r = c.post("/admin/adapters", json={"name": "gamma", "path": adapters["gamma"][0]})
        assert r.status_code == 201, r.text
        assert _complete(c, "gamma").status_code == 200


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--esft-adapter", "no-equals-sign"], "want NAME=DIR"),
        (["--esft-adapter", "a=/x", "--esft-adapter", "a=/y"], "given twice"),
        (["--esft-adapter", "a=/x", "--max-esft-adapters", "0"], "--max-esft-adapters"),
        (["--esft-adapter", "a=/nonexistent"], "--esft-adapter a=/nonexistent"),
    ],
)
def test_cli_rejects_bad_adapter_options(tiny_model_dir, capsys, args, message):
    from elasticmoe.cli import main

    assert main(["serve", "--single", "--model", tiny_model_dir, "--port", "0", *args]) == 2
    assert message in capsys.readouterr().err


def test_lora_adapter_over_http(tiny_model_dir, tmp_path):
    """A LoRA adapter loaded with type=lora on a server with LoRA slots serves its merged model."""
    from elasticmoe.tools.make_lora_adapter import make_lora_adapter, write_lora_merged_model

    path = make_lora_adapter(tiny_model_dir, str(tmp_path / "l"), rank=4,
                             target_modules=("q_proj", "v_proj", "gate_proj", "down_proj"), seed=3)
    merged = write_lora_merged_model(tiny_model_dir, path, str(tmp_path / "m"))
    engine = LLMEngine(EngineConfig(model=tiny_model_dir, dtype=torch.float32, kv_cache_bytes=8 << 20,
                                    max_loras=1, max_lora_rank=4))
    with _serving(engine) as url, httpx.Client(base_url=url, timeout=60) as c:
        r = c.post("/admin/adapters", json={"name": "style", "path": str(path), "type": "lora"})
        assert r.status_code == 201, r.text
        assert r.json()["rank"] == 4
        got = _complete(c, "style", 10)
        assert got.status_code == 200 and got.json()["choices"][0]["text"] == _reference_text(str(merged), 10)
        full = c.post("/admin/adapters", json={"name": "other", "path": str(path), "type": "lora"})
        assert full.status_code == 400 and full.json()["error"]["param"] == "name", full.text  # the host budget
        assert "--max-cpu-loras" in full.json()["error"]["message"]
        bad = c.post("/admin/adapters", json={"name": "x", "path": str(path), "type": "dora"})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "type"
        assert c.delete("/admin/adapters/style").status_code == 200  # idle: unloaded at once
        assert _complete(c, "style").status_code == 404


def test_lora_routing_over_http(tiny_model_dir, tmp_path):
    """`lora_routing` on a completion: routed per token; a bad table or an unknown adapter is a
    4xx naming the field."""
    from elasticmoe.tools.make_lora_adapter import make_lora_adapter

    path = make_lora_adapter(tiny_model_dir, str(tmp_path / "l"), rank=4, seed=3)
    engine = LLMEngine(EngineConfig(model=tiny_model_dir, dtype=torch.float32, kv_cache_bytes=8 << 20,
                                    max_loras=1, max_lora_rank=4))
    with _serving(engine) as url, httpx.Client(base_url=url, timeout=60) as c:
        assert c.post("/admin/adapters", json={"name": "s", "path": str(path), "type": "lora"}).status_code == 201
        body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 6, "temperature": 0}
        ok = c.post("/v1/completions", json={**body, "lora_routing": {"breaks": [256], "adapters": ["s", None]}})
        assert ok.status_code == 200, ok.text
        bad = c.post("/v1/completions", json={**body, "lora_routing": {"breaks": [256], "adapters": ["s"]}})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "lora_routing"
        unknown = c.post("/v1/completions", json={**body, "lora_routing": {"breaks": [256],
                                                                           "adapters": ["nope", None]}})
        assert unknown.status_code == 404 and unknown.json()["error"]["param"] == "model"
        # A learned router over the loaded adapter, then a request routed by it.
        from elasticmoe.adapters.lora_router import random_router

        router_dir = random_router(("s",), 64, top_k=1).save(tmp_path / "router")
        r = c.post("/admin/adapters", json={"name": "mix", "path": str(router_dir), "type": "lora_router"})
        assert r.status_code == 201, r.text
        learned = c.post("/v1/completions", json={**body, "lora_routing": {"type": "learned", "router": "mix"}})
        assert learned.status_code == 200, learned.text
        bad_router = c.post("/admin/adapters", json={"name": "x", "path": str(tmp_path), "type": "lora_router"})
        assert bad_router.status_code == 400 and bad_router.json()["error"]["param"] == "path"


def test_an_adapter_that_fails_to_load_closes_the_built_engine(tiny_model_dir, capsys, monkeypatch):
    from elasticmoe.cli import main
    from elasticmoe.engine.llm_engine import LLMEngine

    closed = []
    monkeypatch.setattr(LLMEngine, "close", lambda self: closed.append(self))
    assert main(["serve", "--single", "--model", tiny_model_dir, "--port", "0", "--esft-adapter", "a=/nonexistent"]) == 2
    assert "--esft-adapter a=/nonexistent" in capsys.readouterr().err
    assert len(closed) == 1  # its threads end with the failed start
