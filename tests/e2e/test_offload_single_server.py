"""`elasticmoe serve --single` with expert offloading, as a user runs it: a subprocess on a free
localhost port. Completions equal the fully resident engine's, the cache shows in /metrics and
/admin/status, LoRA adapters on the attention and on the (offloaded) experts register and answer
like their merged models, two ESFT adapters through one slot (the second
registered on disk) each answer like their merged model, SIGTERM stops the server (prefetch thread
included), and a budget that could never run is refused at start naming the flag (on the elastic
server too, before Ray starts)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import httpx
import pytest

from elasticmoe.cli import main as cli_main
from elasticmoe.llm import LLM
from elasticmoe.sampling_params import SamplingParams
from elasticmoe.tools.make_esft_adapter import make_esft_adapter, write_merged_model
from elasticmoe.tools.make_lora_adapter import make_lora_adapter, write_lora_merged_model
from elasticmoe.utils.ports import free_port

PROMPTS = ["The experts of layer one", "Hello", "A mixture of experts routes every token"]


def _serve(model_dir: str, port: int, *flags: str) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "elasticmoe.cli", "serve", "--single", "--model", model_dir, "--port", str(port),
           "--num-threads", "1", *flags]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "ELASTICMOE_LOG_LEVEL": "WARNING"})


def _wait_ready(proc: subprocess.Popen, url: str, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"server exited {proc.returncode}: {proc.stdout.read() if proc.stdout else ''}")
        try:
            if httpx.get(f"{url}/ready", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    raise AssertionError("server not ready")


@pytest.mark.slow
def test_offloading_server_answers_like_the_resident_engine(tiny_model_dir, tmp_path):
    greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    want = [o.text for o in LLM(tiny_model_dir, dtype="float32").generate(PROMPTS, greedy)]
    attn = make_lora_adapter(tiny_model_dir, str(tmp_path / "attn"), rank=4, target_modules=("q_proj", "v_proj"),
                             seed=1)
    on_experts = make_lora_adapter(tiny_model_dir, str(tmp_path / "experts"), rank=4,
                                   target_modules=("gate_proj", "down_proj"), seed=2)
    want_lora = {name: [o.text for o in LLM(str(write_lora_merged_model(tiny_model_dir, path, str(tmp_path / f"{name}-m"))),
                                             dtype="float32").generate(PROMPTS, greedy)]
                 for name, path in (("attn", attn), ("experts", on_experts))}
    assert all(want_lora[name] != want for name in want_lora)  # the adapters change the text
    esft = {name: make_esft_adapter(tiny_model_dir, str(tmp_path / name), experts_per_layer=2, seed=seed, noise=0.5)
            for seed, name in enumerate(("alpha", "beta"), start=1)}
    want_esft = {name: [o.text for o in LLM(str(write_merged_model(tiny_model_dir, path, str(tmp_path / f"{name}-m"))),
                                             dtype="float32").generate(PROMPTS, greedy)]
                 for name, path in esft.items()}
    assert all(want_esft[name] != want for name in esft)  # the adapters change the text
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = _serve(tiny_model_dir, port, "--expert-cache-fraction", "0.25", "--offload-policy", "lru",
                  "--max-loras", "1", "--max-lora-rank", "4", "--max-esft-adapters", "1", "--max-esft-experts", "2")
    try:
        _wait_ready(proc, url)
        with httpx.Client(base_url=url, timeout=60) as client:
            for prompt, text in zip(PROMPTS, want, strict=True):
                r = client.post("/v1/completions", json={"model": os.path.basename(tiny_model_dir), "prompt": prompt,
                                                         "max_tokens": 8, "temperature": 0, "ignore_eos": True})
                assert r.status_code == 200, r.text
                assert r.json()["choices"][0]["text"] == text
            for name, path in (("attn", attn), ("experts", on_experts)):  # one at a time: one LoRA in host memory
                assert client.post("/admin/adapters", json={"name": name, "path": str(path)}).status_code == 201
                for prompt, text in zip(PROMPTS, want_lora[name], strict=True):
                    r = client.post("/v1/completions", json={"model": name, "prompt": prompt, "max_tokens": 8,
                                                             "temperature": 0, "ignore_eos": True})
                    assert r.status_code == 200, r.text
                    assert r.json()["choices"][0]["text"] == text, name
                assert client.delete(f"/admin/adapters/{name}").status_code == 200  # idle: unloaded at once
            slots = [client.post("/admin/adapters", json={"name": n, "path": str(p)}) for n, p in esft.items()]
            assert [r.json()["slot"] for r in slots] == [0, None], [r.text for r in slots]  # beyond the slot: on disk
            for name in ("beta", "alpha"):
                for prompt, text in zip(PROMPTS, want_esft[name], strict=True):
                    r = client.post("/v1/completions", json={"model": name, "prompt": prompt, "max_tokens": 8,
                                                             "temperature": 0, "ignore_eos": True})
                    assert r.status_code == 200, r.text
                    assert r.json()["choices"][0]["text"] == text, name
            status = client.get("/admin/status").json()
            cache = status["expert_cache"]
            assert cache["policy"] == "lru" and cache["tier"] == "disk" and cache["page_cache"] == "keep"
            assert cache["on_demand_loads"] > 0
            assert cache["resident_experts"] <= cache["capacity_experts"] == 4  # 25% of 2 layers x 8 experts
            lora = status["lora"]  # one slot of every module (attention and experts), emptied by the unloads
            assert (lora["slots"], lora["target_modules"], lora["resident"], lora["loaded"]) == (1, None, 0, 0)
            assert lora["slot_bytes"] > 0
            metrics = client.get("/metrics").text
            assert 'elasticmoe_expert_loads_total{kind="on_demand"}' in metrics
            assert "elasticmoe_expert_cache_hit_rate" in metrics
            assert 'elasticmoe_expert_bytes_loaded_total{tier="disk"}' in metrics
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_a_cache_too_small_for_one_token_is_refused_at_start(tiny_model_dir, capsys):
    args = ["serve", "--single", "--model", tiny_model_dir, "--port", str(free_port()), "--num-threads", "1"]
    assert cli_main([*args, "--expert-cache-gb", "0.00001"]) == 2
    err = capsys.readouterr().err
    assert "--expert-cache-gb" in err and "at least 2" in err


def test_the_elastic_server_refuses_a_device_cache_below_top_k_before_starting(tiny_model_dir, capsys):
    args = ["serve", "--model", tiny_model_dir, "--devices", "2", "--dp", "2", "--port", str(free_port())]
    assert cli_main([*args, "--expert-cache-gb", "0.00001"]) == 2  # checked before Ray starts
    err = capsys.readouterr().err
    assert "--expert-cache-gb: a device's expert cache holds 0 experts" in err and "at least 2" in err
