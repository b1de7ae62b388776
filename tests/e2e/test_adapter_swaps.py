"""More adapters than slots on the elastic server over HTTP (tiny Qwen3-MoE, float32, dp 2 = EP 2).

One ESFT slot for three ESFT adapters and one LoRA slot for two LoRA adapters: the adapters
beyond the slots are registered (201, `"slot": null`) and swapped in when a request needs them
(ESFT by the coordinator, LoRA by the ranks in lockstep). The server runs behind Serve's HTTP proxy, as a KubeRay
RayService runs it (`coordinator.deployment`). Six clients send greedy requests for
a seeded mix of the five adapters and the base model while the instance scales dp 2 -> 1 -> 2:
zero failed requests, and every response equals its merged model's greedy text. Then the admin
view (resident flags, swap counters), and deleting adapters on disk and resident alike returns
every page.
"""

from __future__ import annotations

import random
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import torch
from elastic_server import running, tiny_config

from elasticmoe.config import EngineConfig
from elasticmoe.engine.llm_engine import LLMEngine
from elasticmoe.sampling_params import SamplingParams
from elasticmoe.tools.make_esft_adapter import make_esft_adapter, write_merged_model
from elasticmoe.tools.make_lora_adapter import make_lora_adapter, write_lora_merged_model

pytestmark = pytest.mark.slow

MODEL = "tiny-qwen3-moe"
PROMPT = [5, 6, 7, 8, 9, 10]
MAX_TOKENS = 16
ESFT, LORA = ("alpha", "beta", "gamma"), ("style", "tone")


@pytest.fixture(scope="module")
def adapters(tiny_model_dir, tmp_path_factory) -> dict[str | None, tuple[str, str]]:
    """model name -> (adapter dir, greedy text of its merged model); None -> the base model."""
    root = tmp_path_factory.mktemp("swaps")
    out: dict[str | None, tuple[str, str]] = {None: ("", _reference(tiny_model_dir))}
    for seed, name in enumerate(ESFT, start=1):
        path = make_esft_adapter(tiny_model_dir, str(root / name), experts_per_layer=2, seed=seed, noise=0.5)
        out[name] = (str(path), _reference(str(write_merged_model(tiny_model_dir, path, str(root / f"{name}-m")))))
    for seed, name in enumerate(LORA, start=11):
        path = make_lora_adapter(tiny_model_dir, str(root / name), rank=4, seed=seed,
                                 target_modules=("q_proj", "v_proj", "gate_proj", "up_proj", "down_proj"))
        merged = write_lora_merged_model(tiny_model_dir, str(path), str(root / f"{name}-m"))
        out[name] = (str(path), _reference(str(merged)))
    assert len({text for _, text in out.values()}) == len(out)  # every adapter changes the text
    return out


def _reference(model_dir: str) -> str:
    engine = LLMEngine(EngineConfig(model=model_dir, dtype=torch.float32, num_kv_blocks=64, num_threads=1))
    engine.add_request("ref", PROMPT, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True))
    while engine.has_unfinished_requests():
        done = [o for o in engine.step() if o.finished]
    return done[0].text


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    config = tiny_config(tiny_model_dir, num_devices=2, dp=2, max_esft_adapters=1, max_esft_experts=2, max_loras=1,
                         max_cpu_loras=4, max_lora_rank=4)
    with running(config, via_serve_proxy=True) as srv:  # as KubeRay runs it: every request through Serve's proxy
        yield srv


def _complete(url: str, model: str | None) -> tuple[str | None, int, str]:
    body = {"model": model or MODEL, "prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}
    with httpx.Client(base_url=url, timeout=120) as c:
        r = c.post("/v1/completions", json=body)
    return model, r.status_code, r.json()["choices"][0]["text"] if r.status_code == 200 else r.text


def _used(c: httpx.Client) -> int:
    return sum(d["used_bytes"] for d in c.get("/admin/status").json()["devices"])


def _wait_scale(c: httpx.Client, event_id: str) -> dict:
    deadline = time.monotonic() + 120
    while (event := c.get(f"/admin/scale/{event_id}").json())["state"] in ("pending", "running"):
        assert time.monotonic() < deadline, event
        time.sleep(0.1)
    return event


def test_adapters_beyond_the_slots_serve_their_merged_models_across_scaling(server, adapters):
    from ray import serve

    assert len(serve.status().proxies) == 1  # the requests below all cross Serve's proxy
    with httpx.Client(base_url=server.url, timeout=60) as c:
        before = _used(c)
        for name in (*ESFT, *LORA):  # the kind is read from the files
            r = c.post("/admin/adapters", json={"name": name, "path": adapters[name][0], "usage_probability": 0.2})
            assert r.status_code == 201, r.text
        assert _used(c) > before  # the resident adapter's experts got pages on the devices of their base experts
        listed = {a["name"]: a for a in c.get("/admin/adapters").json()["adapters"]}
        assert {a["usage_probability"] for a in listed.values()} == {0.2}
        assert [listed[n]["slot"] for n in ESFT] == [0, None, None]  # beyond the slot: registered on disk
        assert [listed[n]["resident"] for n in ESFT] == [True, False, False]
        assert {m["id"] for m in c.get("/v1/models").json()["data"]} >= {*ESFT, *LORA}

        rng = random.Random(7)
        models = [rng.choice([None, *ESFT, *LORA]) for _ in range(36)]
        with ThreadPoolExecutor(6) as pool:
            results = pool.map(lambda m: _complete(server.url, m), models)
            time.sleep(1.0)  # swaps under way
            for dp in (1, 2):
                r = c.post("/admin/scale", json={"dp": dp})
                assert r.status_code == 202, r.text
                assert _wait_scale(c, r.json()["event_id"])["state"] == "succeeded"
            results = list(results)
        wrong = [(m, status, text) for m, status, text in results if status != 200 or text != adapters[m][1]]
        assert not wrong, wrong
        assert {m for m in models if m in ESFT} == set(ESFT)  # each was asked for, so each was swapped in

        status = c.get("/admin/status").json()
        swaps = status["adapter_swaps"]
        assert swaps["esft_swaps_in"] >= 2 and swaps["esft_evictions"] >= 2, swaps
        assert swaps["lora_swaps"] == "lockstep"  # slots on the experts, dp 2 after the scales
        listed = {a["name"]: a for a in c.get("/admin/adapters").json()["adapters"]}
        assert sum(listed[n]["resident"] for n in ESFT) == 1  # one slot
        # The host cache holds --max-cpu-loras 4 LoRA adapters: a fifth is refused naming the field.
        extra = [f"lora-extra-{i}" for i in range(2)]
        for name in extra:
            assert c.post("/admin/adapters", json={"name": name, "path": adapters[LORA[0]][0]}).status_code == 201
        over = c.post("/admin/adapters", json={"name": "lora-over", "path": adapters[LORA[0]][0]})
        assert over.status_code == 400 and over.json()["error"]["param"] == "name", over.text
        assert "--max-cpu-loras" in over.json()["error"]["message"]
        for name in (*ESFT, *LORA, *extra):  # on disk or resident alike
            assert c.delete(f"/admin/adapters/{name}").status_code in (200, 202)
        deadline = time.monotonic() + 30
        while c.get("/admin/adapters").json()["adapters"]:
            assert time.monotonic() < deadline
            time.sleep(0.1)
        assert c.post("/v1/completions", json={"model": "alpha", "prompt": PROMPT}).status_code == 404
        assert _used(c) == before  # every page returned
