"""Streaming clients for the multi-node e2e tests: greedy completions streamed back to back, and
their oracle (a single-process `LLMEngine` run of the same prompts).

Each module that uses them defines the `reference` fixture as `reference_outputs(tiny_model_dir)`.
"""

from __future__ import annotations

import contextlib
import json
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import torch

from coordinator.bench.local_nodes import Served
from elasticmoe.config import EngineConfig
from elasticmoe.engine.llm_engine import LLMEngine
from elasticmoe.sampling_params import SamplingParams
from elasticmoe.tools.make_esft_adapter import make_esft_adapter, write_merged_model

MODEL = "tiny-qwen3-moe"
PROMPTS = [[5, 6, 7, 8, 9, 10], [11, 12, 13], [20, 21, 22, 23], [30, 31]]
MAX_TOKENS = 200  # clients stream back to back, so some request is mid-flight at every switchover


def reference_outputs(tiny_model_dir: str) -> list[tuple[str, int]]:
    """(text, num_output_tokens) per prompt, single process, float32, greedy."""
    engine = LLMEngine(
        EngineConfig(model=tiny_model_dir, dtype=torch.float32, num_kv_blocks=1024, num_threads=1)
    )
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(f"ref-{i}", prompt, params)
    final = {}
    while engine.has_unfinished_requests():
        final.update({o.request_id: o for o in engine.step() if o.finished})
    return [(final[f"ref-{i}"].text, len(final[f"ref-{i}"].output_token_ids)) for i in range(len(PROMPTS))]


def metric_values(metrics: str, prefix: str) -> list[float]:
    """The values of the `/metrics` text's samples whose line starts with `prefix` (name{labels...)."""
    return [float(line.split()[-1]) for line in metrics.splitlines() if line.startswith(prefix)]


def client(server: Served) -> httpx.Client:
    return httpx.Client(base_url=server.url, timeout=120)


def stream(server: Served, prompt: list[int]) -> tuple[str, int]:
    """(streamed text, completion_tokens) of one streaming greedy completion."""
    body = {
        "model": MODEL,
        "prompt": prompt,
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    text, usage = [], None
    with client(server) as c, c.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[len("data: ") :])
            assert "error" not in chunk, chunk  # a failed request
            if chunk.get("usage"):
                usage = chunk["usage"]
            text += [c["text"] for c in chunk["choices"]]
    assert usage is not None
    return "".join(text), usage["completion_tokens"]


def client_loop(server: Served, first: int, stop: threading.Event) -> list[tuple[int, tuple[str, int]]]:
    """Stream back to back (cycling through the prompts) until `stop`; (prompt index, result) each."""
    results, i = [], first
    while not stop.is_set():
        results.append((i, stream(server, PROMPTS[i])))
        i = (i + 1) % len(PROMPTS)
    return results


@contextlib.contextmanager
def clients_streaming(server: Served, num_clients: int) -> Iterator[list[tuple[int, tuple[str, int]]]]:
    """`num_clients` clients stream back to back (`client_loop`) while the body runs; the list it
    yields holds their (prompt index, result) once they have stopped, after the body."""
    stop, results = threading.Event(), []
    with ThreadPoolExecutor(num_clients) as pool:
        loops = [pool.submit(client_loop, server, i, stop) for i in range(num_clients)]
        try:
            yield results
        finally:
            stop.set()
        results.extend(r for f in loops for r in f.result(timeout=300))


def greedy_completion(c: httpx.Client, model: str, prompt: list[int]) -> tuple[str, int]:
    """(text, completion_tokens) of one non-streaming greedy completion, as `reference_outputs` gives."""
    r = c.post("/v1/completions", json={"model": model, "prompt": prompt, "max_tokens": MAX_TOKENS,
                                        "temperature": 0, "ignore_eos": True})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"], r.json()["usage"]["completion_tokens"]


def esft_adapters(tiny_model_dir: str, root: Path, names: tuple[str, ...] = ("alpha", "beta")
                  ) -> tuple[dict[str, Path], dict[str, list[tuple[str, int]]]]:
    """ESFT adapters of the tiny model written under `root` (2 tuned experts per layer), and each
    one's merged model's `reference_outputs`."""
    adapters = {name: make_esft_adapter(tiny_model_dir, str(root / name), experts_per_layer=2, seed=seed, noise=0.5)
                for seed, name in enumerate(names, start=1)}
    want = {name: reference_outputs(str(write_merged_model(tiny_model_dir, path, str(root / f"{name}-m"))))
            for name, path in adapters.items()}
    return adapters, want


def check_esft_swaps(c: httpx.Client, adapters: dict[str, Path], want: dict[str, list[tuple[str, int]]]) -> None:
    """Register `adapters` (more than the server's one slot), then ask for each in turn and back to
    the first: each request swaps its adapter in, and its tokens equal its merged model's."""
    for name, path in adapters.items():
        assert c.post("/admin/adapters", json={"name": name, "path": str(path)}).status_code == 201
    names = list(adapters)
    for name in [*names, names[0]]:
        for i in range(2):
            assert greedy_completion(c, name, PROMPTS[i]) == want[name][i], name


def check_swap_for_a_client_that_left(c: httpx.Client, resident: str, on_disk: str,
                                      want: dict[str, list[tuple[str, int]]]) -> None:
    """A client asks for an adapter on disk and leaves while the swap waits for the one slot's long
    request: the ingress tells the coordinator (`esft_unwanted`), which then does not hold the slot
    for a request that will never come, and the resident adapter's next request swaps it back as
    usual. (Behind Serve's HTTP proxy the ingress is not told of the client leaving: the request
    goes on, reaches its rank and frees the slot by arriving.)"""
    unwanted = c.get("/admin/status").json()["adapter_swaps"]["esft_unwanted"]
    long_body = {"model": resident, "prompt": PROMPTS[0], "max_tokens": 400, "temperature": 0, "ignore_eos": True}
    with ThreadPoolExecutor(1) as pool:
        long_request = pool.submit(c.post, "/v1/completions", json=long_body)
        time.sleep(0.3)  # the long request runs: the swap below waits for it
        with contextlib.suppress(httpx.TimeoutException):
            c.post("/v1/completions", timeout=0.5,
                   json={"model": on_disk, "prompt": PROMPTS[1], "max_tokens": 8, "temperature": 0})
            raise AssertionError("the swap did not wait for the long request")
        assert long_request.result().status_code == 200
    deadline = time.monotonic() + 30
    while c.get("/admin/status").json()["adapter_swaps"]["esft_unwanted"] == unwanted:
        assert time.monotonic() < deadline, "the swap of a client that left was not reported unwanted"
        time.sleep(0.1)
    assert greedy_completion(c, resident, PROMPTS[0]) == want[resident][0]


def scale(c: httpx.Client, dp: int) -> str:
    r = c.post("/admin/scale", json={"dp": dp})
    assert r.status_code == 202, r.text
    return str(r.json()["event_id"])


def wait_event(c: httpx.Client, event_id: str, timeout_s: float = 120) -> dict:
    deadline = time.monotonic() + timeout_s
    while (event := c.get(f"/admin/scale/{event_id}").json())["state"] == "running":
        assert time.monotonic() < deadline, event
        time.sleep(0.05)
    return event
