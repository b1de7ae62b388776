"""The elastic server over HTTP: Ray Serve coordinator, HMM on 2 logical devices, a dp=2 instance.

One local Ray session and one Serve app per module (tiny Qwen3-MoE, float32),
on a free localhost port, driven by a real HTTP client. Checks what users see:
completions and chat (streamed text equals the non-streamed greedy text), usage,
/v1/models, /health, /ready, /admin/status, /metrics, the bad-input table (each
a 4xx naming the field, the server healthy after) and the bounded queue (503 +
Retry-After). Teardown must leave no /dev/shm file behind.
"""

from __future__ import annotations

import contextlib
import json
import re
import time
from pathlib import Path

import httpx
import pytest
from bad_inputs import CASES, ELASTIC_CASES, check_error
from elastic_server import running, tiny_config
from streaming_clients import metric_values

from coordinator.launch import ElasticServer

pytestmark = pytest.mark.slow

MODEL = "tiny-qwen3-moe"
MAX_QUEUED = 3
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is an expert?"}]


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    # One LoRA slot of q_proj only per rank (under EP, dp=2; each rank swaps its own) and three
    # adapters in host memory: what an adapter on other modules meets, and swaps per rank.
    with running(tiny_config(tiny_model_dir, dp=2, max_queued=MAX_QUEUED, served_model_name=MODEL, max_loras=1,
                             max_cpu_loras=3, max_lora_rank=4, lora_target_modules=("q_proj",))) as srv:
        yield srv


def _client(server: ElasticServer, timeout: float = 60) -> httpx.Client:
    return httpx.Client(base_url=server.url, timeout=timeout)


def _engine_steps(server: ElasticServer) -> float:
    with _client(server) as c:
        metrics = c.get("/metrics").text
    return sum(metric_values(metrics, "elasticmoe_engine_steps_total "))


def _post(server: ElasticServer, path: str, body: dict) -> httpx.Response:
    with _client(server) as c:
        return c.post(path, json={"model": MODEL, **body})


def _sse(response: httpx.Response) -> list[dict]:
    events = [e for e in response.text.split("\n\n") if e]
    assert events and events[-1] == "data: [DONE]"
    return [json.loads(e[len("data: ") :]) for e in events[:-1]]


def test_the_ingress_listens_itself_and_serve_runs_no_proxy(server):
    import psutil  # NOTE: Ray's vendored copy, importable once ray is
    from ray import serve

    port = int(server.url.rsplit(":", 1)[1])
    assert serve.status().proxies == {}  # nothing of Serve's on the way of a token
    listening = [c for c in psutil.Process(server.ingress_pid).net_connections("tcp")
                 if c.status == psutil.CONN_LISTEN and c.laddr.port == port]
    assert listening, f"the ingress (pid {server.ingress_pid}) does not listen on {port}"


def test_completion_and_chat_with_usage(server):
    r = _post(server, "/v1/completions", {"prompt": "the expert model serves", "max_tokens": 8, "temperature": 0})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "text_completion" and body["model"] == MODEL
    usage = body["usage"]
    assert usage["prompt_tokens"] > 0 and 1 <= usage["completion_tokens"] <= 8
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    assert body["choices"][0]["finish_reason"] in ("stop", "length")

    r = _post(server, "/v1/chat/completions", {"messages": CHAT, "max_completion_tokens": 6, "temperature": 0})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "chat.completion" and body["choices"][0]["message"]["role"] == "assistant"
    assert 1 <= body["usage"]["completion_tokens"] <= 6


def test_penalties_and_logit_bias_reach_the_rank(server, tiny_model_dir):
    """Through the ingress, the coordinator and the rank: a bias of 100 forces its token, and greedy
    tokens under penalties equal an in-process engine's with the same parameters."""
    from elasticmoe.llm import LLM
    from elasticmoe.sampling_params import SamplingParams

    llm = LLM(tiny_model_dir, dtype="float32")
    forced = _post(server, "/v1/completions", {"prompt": [5, 6, 7], "max_tokens": 5, "temperature": 0.7,
                                               "logit_bias": {"42": 100}, "ignore_eos": True})
    assert forced.status_code == 200, forced.text
    assert forced.json()["choices"][0]["text"] == llm.engine.tokenizer.decode([42] * 5)

    prompt = [11, 22, 33, 44]
    r = _post(server, "/v1/completions", {"prompt": prompt, "max_tokens": 12, "temperature": 0, "ignore_eos": True,
                                          "presence_penalty": 0.9, "frequency_penalty": 0.7, "logit_bias": {"9": 2.5}})
    assert r.status_code == 200, r.text
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, presence_penalty=0.9,
                            frequency_penalty=0.7, logit_bias={9: 2.5})
    [expected] = llm.generate([prompt], params)
    plain = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))[0]
    assert r.json()["choices"][0]["text"] == expected.text != plain.text


def test_structured_outputs_and_tool_calls_through_the_ingress(server, tiny_model_dir):
    """The constraint crosses to the rank with the request: greedy under a regex equals an in-process
    engine's; a chat answer matches its JSON schema; "required" answers calls of the tools."""
    import jsonschema

    from elasticmoe.llm import LLM
    from elasticmoe.sampling_params import SamplingParams
    from elasticmoe.structured_outputs import StructuredOutputs

    r = _post(server, "/v1/completions", {"prompt": [11, 22, 33], "max_tokens": 16, "temperature": 0,
                                          "guided_regex": "[a-z]{3,6}-[0-9]{2}"})
    assert r.status_code == 200, r.text
    constraint = StructuredOutputs.text("regex", "[a-z]{3,6}-[0-9]{2}", "guided_regex")
    [expected] = LLM(tiny_model_dir, dtype="float32").generate(
        [[11, 22, 33]], SamplingParams(temperature=0.0, max_tokens=16, structured_outputs=constraint))
    assert r.json()["choices"][0]["text"] == expected.text and r.json()["choices"][0]["finish_reason"] == "stop"
    schema = {"type": "object", "required": ["a"], "additionalProperties": False,
              "properties": {"a": {"enum": ["x", "y"]}}}
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 32, "temperature": 1.0, "seed": 5}
    r = _post(server, "/v1/chat/completions", {**chat, "n": 2, "response_format": {
        "type": "json_schema", "json_schema": {"name": "s", "schema": schema}}})
    assert r.status_code == 200, r.text
    for choice in r.json()["choices"]:
        jsonschema.validate(json.loads(choice["message"]["content"]), schema)
    tools = [{"type": "function", "function": {"name": "pick", "parameters": schema}}]
    r = _post(server, "/v1/chat/completions", {**chat, "tools": tools, "tool_choice": "required",
                                               "parallel_tool_calls": False, "max_tokens": 128})
    assert r.status_code == 200, r.text
    [call] = r.json()["choices"][0]["message"]["tool_calls"]
    assert call["function"]["name"] == "pick" and r.json()["choices"][0]["finish_reason"] == "tool_calls"
    jsonschema.validate(json.loads(call["function"]["arguments"]), schema)


def test_n_choices_through_the_ingress(server):
    """Each choice is a request of its own through the router: greedy choices equal the one-choice
    answer, seeded ones its seed + i, and a stream carries both by index."""
    base = {"prompt": [11, 22, 33], "max_tokens": 6, "ignore_eos": True}
    one = _post(server, "/v1/completions", {**base, "temperature": 0}).json()["choices"][0]["text"]
    two = _post(server, "/v1/completions", {**base, "temperature": 0, "n": 2}).json()
    assert [c["text"] for c in two["choices"]] == [one, one] and two["usage"]["completion_tokens"] == 12
    seeded = {**base, "temperature": 1.0, "seed": 3}
    texts = [c["text"] for c in _post(server, "/v1/completions", {**seeded, "n": 2}).json()["choices"]]
    assert texts == [_post(server, "/v1/completions", {**seeded, "seed": 3 + i}).json()["choices"][0]["text"]
                     for i in range(2)]
    chunks = _sse(_post(server, "/v1/completions", {**seeded, "n": 2, "stream": True}))
    streamed = ["", ""]
    for chunk in chunks:
        streamed[chunk["choices"][0]["index"]] += chunk["choices"][0]["text"]
    assert streamed == texts


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_stream_equals_greedy_non_stream(server, path):
    base = {"max_tokens": 12, "temperature": 0, "ignore_eos": True}
    base.update({"messages": CHAT} if "chat" in path else {"prompt": "elastic scale of the router"})
    full = _post(server, path, base).json()
    r = _post(server, path, {**base, "stream": True, "stream_options": {"include_usage": True}})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    chunks = _sse(r)
    usage_chunk, chunks = chunks[-1], chunks[:-1]
    # the same counts; the router sent the second request to the rank that had computed the prompt
    # (prefix affinity), whose cache held its full blocks
    cached = usage_chunk["usage"].pop("prompt_tokens_details")["cached_tokens"]
    assert usage_chunk["usage"] == {k: v for k, v in full["usage"].items() if k != "prompt_tokens_details"}
    assert full["usage"]["completion_tokens"] == 12 and cached == (full["usage"]["prompt_tokens"] - 1) // 16 * 16
    if "chat" in path:
        text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
        expected = full["choices"][0]["message"]["content"]
    else:
        text = "".join(c["choices"][0]["text"] for c in chunks)
        expected = full["choices"][0]["text"]
    assert text == expected
    assert chunks[-1]["choices"][0]["finish_reason"] == "length" == full["choices"][0]["finish_reason"]


def test_models_health_ready_status_metrics(server):
    assert _post(server, "/v1/completions", {"prompt": "x", "max_tokens": 3, "ignore_eos": True}).status_code == 200
    with _client(server) as c:
        models = c.get("/v1/models").json()
        assert [m["id"] for m in models["data"]] == [MODEL] and models["data"][0]["max_model_len"] > 0
        assert c.get("/health").status_code == 200
        assert c.get("/ready").status_code == 200
        status = c.get("/admin/status").json()
        assert status["active_config"]["dp"] == 2 and status["instance"]["state"] == "active"
        assert [d["device_id"] for d in status["devices"]] == [0, 1]
        assert all(d["used_bytes"] > 0 for d in status["devices"])
        assert status["scale_event"] is None and status["requests"]["max_queued"] == MAX_QUEUED
        for compute in (a["compute"] for a in status["instance"]["attach"]):  # what each rank's CPU chose
            assert compute["kernel_isa"] in ("amx", "avx512_bf16", "avx512", "avx2", "none") and compute["compute_dtype"]
            # the weights as held (the tiny checkpoint is fp32: the HMM's shared memory holds fp32)
            assert compute["dense_weight_dtype"] == compute["expert_weight_dtype"] == "float32"
        text = c.get("/metrics").text
    assert 'elasticmoe_http_requests_total{endpoint="/v1/completions",status="200"}' in text
    for name in (
        "elasticmoe_time_to_first_token_seconds_count",
        "elasticmoe_time_per_output_token_seconds_count",
        "elasticmoe_e2e_request_latency_seconds_count",
        "elasticmoe_num_requests_queued",
        'elasticmoe_kv_cache_usage_ratio{rank="1"}',
        "elasticmoe_active_dp 2.0",
    ):
        assert name in text, name


BAD_INPUTS = [
    ("/v1/completions", {"model": "no-such-model", "prompt": "x"}, 404, "model"),
    ("/v1/completions", {"prompt": "expert " * 3000}, 400, "prompt"),
    ("/v1/completions", {"prompt": "x", "temperature": -1}, 400, "temperature"),
    ("/v1/completions", {"prompt": "x", "top_p": 1.5}, 400, "top_p"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 100000}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "n": 17}, 400, "n"),
    ("/v1/completions", {"prompt": "x", "stop_token_ids": ["eos"]}, 400, "stop_token_ids"),
    ("/v1/completions", {"prompt": "x", "stop_token_ids": [10**9]}, 400, "stop_token_ids"),
    ("/v1/completions", {"prompt": "x", "logprobs": 1000}, 400, "logprobs"),
    ("/v1/completions", {"max_tokens": 2}, 400, "prompt"),
    ("/v1/chat/completions", {"max_tokens": 2}, 400, "messages"),
    ("/v1/chat/completions", {"messages": []}, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "expert " * 3000}]}, 400, "messages"),
]


def test_adapter_files_the_base_cannot_take_are_400s_naming_the_field(server, tmp_path):
    """The coordinator opens and checks an adapter's files (the ingress only tells its kind): its
    refusal crosses Ray to the client as a 400 naming the field, and nothing is registered."""
    esft = tmp_path / "esft"
    esft.mkdir()
    (esft / "expert_cfg.json").write_text(json.dumps({"experts": {"1": [0, 999]}}))
    lora = tmp_path / "lora"
    lora.mkdir()
    (lora / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 4, "lora_alpha": 8,
                                                          "target_modules": ["q_proj"]}))
    router = tmp_path / "router"
    router.mkdir()
    (router / "router_config.json").write_text("{not json")
    with _client(server) as c:
        for name, path, param in (("esft-bad", esft, "experts"), ("lora-bad", lora, "path"), ("router-bad", router, "path")):
            r = c.post("/admin/adapters", json={"name": name, "path": str(path)})
            assert r.status_code == 400, (name, r.text)
            error = r.json()["error"]
            assert error["param"] == param and "Traceback" not in error["message"], (name, error)
        assert c.get("/admin/adapters").json()["adapters"] == []
        assert [m["id"] for m in c.get("/v1/models").json()["data"]] == [MODEL]


def test_an_adapter_on_modules_the_slots_do_not_hold_is_a_400_on_every_rank_and_one_on_them_serves(
        server, tiny_model_dir, tmp_path):
    from elasticmoe.tools.make_lora_adapter import make_lora_adapter

    qv = make_lora_adapter(tiny_model_dir, str(tmp_path / "qv"), rank=4, target_modules=("q_proj", "v_proj"), seed=1)
    q = make_lora_adapter(tiny_model_dir, str(tmp_path / "q"), rank=4, target_modules=("q_proj",), seed=2)
    greedy = {"prompt": "the expert model", "max_tokens": 4, "temperature": 0, "ignore_eos": True}
    with _client(server) as c:
        r = c.post("/admin/adapters", json={"name": "qv", "path": str(qv)})
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["param"] == "target_modules" and "--lora-target-modules" in error["message"], error
        assert c.get("/admin/adapters").json()["adapters"] == []
        assert c.post("/admin/adapters", json={"name": "q", "path": str(q)}).status_code == 201
        metrics = c.get("/metrics").text  # each rank's slot, its private memory: q_proj's factors only
        slot_bytes = [float(v) for v in re.findall(r'^elasticmoe_lora_slot_bytes\{rank="\d+"\} (\S+)$', metrics, re.M)]
        assert len(slot_bytes) == 2 and min(slot_bytes) > 0, metrics
        try:
            r = c.post("/v1/completions", json={**greedy, "model": "q"})
            assert r.status_code == 200, r.text
        finally:
            assert c.delete("/admin/adapters/q").status_code in (200, 202)  # 202: once its requests ended
            deadline = time.monotonic() + 30
            while c.get("/admin/adapters").json()["adapters"] and time.monotonic() < deadline:
                time.sleep(0.2)


def test_more_adapters_than_each_ranks_slot_swap_per_rank_and_serve_their_merged_models(
        server, tiny_model_dir, tmp_path):
    """Slots of attention modules only (q_proj here) serve their own rank's tokens: each rank swaps its
    one slot on its own (no lockstep), three adapters through it, and every response equals its
    merged model's greedy text, also across a scale 2 -> 1 -> 2 beneath them; deleting adapters
    resident on one rank only returns them all."""
    from concurrent.futures import ThreadPoolExecutor

    import torch

    from elasticmoe.config import EngineConfig
    from elasticmoe.engine.llm_engine import LLMEngine
    from elasticmoe.sampling_params import SamplingParams
    from elasticmoe.tools.make_lora_adapter import make_lora_adapter, write_lora_merged_model

    prompt, names = [5, 6, 7, 8, 9, 10], ("qa", "qb", "qc")
    paths = {n: make_lora_adapter(tiny_model_dir, str(tmp_path / n), rank=4, target_modules=("q_proj",), seed=20 + i)
             for i, n in enumerate(names)}

    def greedy(model_dir: str) -> str:
        engine = LLMEngine(EngineConfig(model=model_dir, dtype=torch.float32, num_kv_blocks=64, num_threads=1))
        engine.add_request("ref", prompt, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
        while engine.has_unfinished_requests():
            done = [o for o in engine.step() if o.finished]
        return done[0].text

    want = {n: greedy(str(write_lora_merged_model(tiny_model_dir, str(p), str(tmp_path / f"{n}-m"))))
            for n, p in paths.items()}
    assert len(set(want.values())) == len(names)  # every adapter changes the text

    def complete(model: str) -> tuple[str, int, str]:
        body = {"model": model, "prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True}
        with _client(server, timeout=120) as c:
            r = c.post("/v1/completions", json=body)
        return model, r.status_code, r.json()["choices"][0]["text"] if r.status_code == 200 else r.text

    with _client(server) as c:
        swaps_before = sum(metric_values(c.get("/metrics").text, "elasticmoe_lora_swaps_in_total") or [0.0])
        for n in names:
            assert c.post("/admin/adapters", json={"name": n, "path": str(paths[n])}).status_code == 201
        try:
            models = [names[i % 3] for i in range(24)]
            with ThreadPoolExecutor(2) as pool:
                during = pool.map(complete, models)
                time.sleep(0.2)  # swaps under way, then the instance scales 2 -> 1 -> 2 beneath them
                for dp in (1, 2):
                    r = c.post("/admin/scale", json={"dp": dp})
                    assert r.status_code == 202, r.text
                    deadline = time.monotonic() + 120
                    while (event := c.get(f"/admin/scale/{r.json()['event_id']}").json())["state"] in ("pending",
                                                                                                       "running"):
                        assert time.monotonic() < deadline, event
                        time.sleep(0.1)
                    assert event["state"] == "succeeded", event
                results = [*during, *pool.map(complete, names * 2)]  # and on the new instance's slots
            wrong = [(m, status, out) for m, status, out in results if status != 200 or out != want[m]]
            assert not wrong, wrong
            swaps = sum(metric_values(c.get("/metrics").text, "elasticmoe_lora_swaps_in_total") or [0.0])
            assert swaps - swaps_before >= 2  # two adapters beyond the slot came in, on some rank
            assert c.get("/admin/status").json()["adapter_swaps"]["lora_swaps"] == "per rank"
        finally:
            for n in names:
                assert c.delete(f"/admin/adapters/{n}").status_code in (200, 202)
            deadline = time.monotonic() + 30
            while c.get("/admin/adapters").json()["adapters"] and time.monotonic() < deadline:
                time.sleep(0.2)
            assert c.get("/admin/adapters").json()["adapters"] == []


@pytest.mark.parametrize("path,body,status,param", BAD_INPUTS)
def test_bad_input_is_rejected(server, path, body, status, param):
    r = _post(server, path, body)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["param"] == param and error["message"] and error["type"]


def test_bad_input_table_each_exact_4xx_and_the_server_serves_on(server):
    greedy = {"prompt": "the expert model", "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    before = _post(server, "/v1/completions", greedy).json()["choices"][0]["text"]
    failures = []
    with _client(server) as c:
        for case in CASES + ELASTIC_CASES:
            _, method, path, body, _, _ = case
            if isinstance(body, bytes):
                r = c.request(method, path, content=body, headers={"content-type": "application/json"})
            else:
                r = c.request(method, path, json=body) if body is not None else c.request(method, path)
            try:
                check_error(case, r.status_code, r.json())
            except (AssertionError, ValueError) as exc:
                failures.append(f"{case[0]}: {exc} ({r.status_code} {r.text[:200]!r})\n")
        assert c.get("/health").status_code == 200 and c.get("/ready").status_code == 200
        assert c.get("/admin/status").json()["scale_event"] is None  # no bad scale request started one
    assert not failures, "".join(failures)
    assert _post(server, "/v1/completions", greedy).json()["choices"][0]["text"] == before


def test_malformed_json_is_400_and_server_healthy_after_bad_input(server):
    with _client(server) as c:
        r = c.post("/v1/chat/completions", content=b'{"model": "x", "messages": [',
                   headers={"content-type": "application/json"})
        assert r.status_code == 400 and r.json()["error"]["type"] == "BadRequestError"
        assert c.get("/health").status_code == 200
        assert c.get("/admin/status").json()["requests"]["queued"] == 0
    ok = _post(server, "/v1/completions", {"prompt": "x", "max_tokens": 2})
    assert ok.status_code == 200, ok.text


def test_queue_overflow_is_503_with_retry_after(server):
    with _client(server) as c:
        max_model_len = c.get("/v1/models").json()["data"][0]["max_model_len"]
    # As long as the context allows: the streams must still run when the extra request arrives.
    long = {"model": MODEL, "prompt": "the queue", "stream": True, "max_tokens": max_model_len - 8,
            "ignore_eos": True}
    steps_before = _engine_steps(server)
    with contextlib.ExitStack() as stack:
        lines = []  # NOTE: keep the line iterators alive; closing one would close its stream
        for _ in range(MAX_QUEUED):  # fill the queue with streams that are already producing tokens
            c = stack.enter_context(_client(server))
            r = stack.enter_context(c.stream("POST", "/v1/completions", json=long))
            assert r.status_code == 200
            lines.append(r.iter_lines())
            assert next(lines[-1]).startswith("data: ")
        with _client(server) as c:
            assert c.get("/admin/status").json()["requests"]["queued"] == MAX_QUEUED
        over = _post(server, "/v1/completions", {"prompt": "x", "max_tokens": 2})
        assert over.status_code == 503, over.text
        assert int(over.headers["Retry-After"]) >= 1
        assert over.json()["error"]["type"] == "ServiceUnavailableError"
    # The streams were closed mid-way: their requests are aborted and the queue drains.
    deadline = time.monotonic() + 30
    with _client(server) as c:
        # Queue empty and nothing left in the ranks' engines (the requests were aborted, not run to the end).
        while c.get("/admin/status").json()["requests"]["queued"] or (
            "elasticmoe_num_requests_running 0.0" not in c.get("/metrics").text
        ):
            assert time.monotonic() < deadline, "requests kept running after their clients left"
            time.sleep(0.1)
        assert c.get("/health").status_code == 200
    # Aborted, not run to their end: run out, the streams would have taken max_tokens steps on each
    # of the two lockstep ranks (the counter sums them).
    assert _engine_steps(server) - steps_before < long["max_tokens"]
    assert _post(server, "/v1/completions", {"prompt": "x", "max_tokens": 2}).status_code == 200


def test_schemathesis_over_every_route_gets_no_server_error(server):
    """Positive and negative requests from the coordinator's own OpenAPI document (schemathesis),
    every route but `POST /admin/drain` (it answers everything after it 503, by design): no
    answer of 500 or above, and the server still serves and holds no request afterwards."""
    import schemathesis
    from schema_fuzz import CONFIG, fuzz

    schema = schemathesis.openapi.from_url(f"{server.url}/openapi.json", config=CONFIG).exclude(path="/admin/drain")
    calls = fuzz(schema, max_examples=25, base_url=server.url)
    assert {k.rsplit(" ", 1)[0] for k in calls} >= {"POST /admin/scale", "GET /admin/status", "POST /v1/completions",
                                                     "POST /admin/autoscaler", "GET /admin/scale/{event_id}"}
    with _client(server) as c:
        c.post("/admin/autoscaler", json={"enabled": False})  # a positive example may have turned it on
        deadline = time.monotonic() + 60
        while c.get("/admin/status").json()["scale_event"] is not None:  # a generated scale may still run
            assert time.monotonic() < deadline
            time.sleep(0.2)
        assert c.get("/ready").status_code == 200 and c.get("/health").json()["status"] == "ok"
    assert _post(server, "/v1/completions", {"prompt": "x", "max_tokens": 2}).status_code == 200


def test_the_ingress_served_every_route_above_without_loading_pytorch(server):
    """The ingress holds connections and routes requests; the tensors are the ranks' and the HMM's.
    After every route of this module went through it (schemathesis last), its process has not
    mapped libtorch, while the coordinator's has (so the check can see it)."""
    def maps_torch(pid: int | None) -> bool:
        assert pid is not None, "the replica runs on another node"
        return "libtorch" in Path(f"/proc/{pid}/maps").read_text()

    assert not maps_torch(server.ingress_pid)
    assert maps_torch(server.coordinator_pid)
