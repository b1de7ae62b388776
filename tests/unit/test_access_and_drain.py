"""API keys, size limits and drain on the single server's app over `FakeEngine` (no model)."""

from __future__ import annotations

import asyncio
import logging

import httpx
import pytest
from fake_engine import FakeEngine

from elasticmoe.engine.async_llm import AsyncLLM
from elasticmoe.entrypoints.openai.access import AccessPolicy
from elasticmoe.entrypoints.openai.api_server import build_app
from elasticmoe.entrypoints.openai.drain import Drainer

MODEL = "fake"
API_KEY = "sk-api-0123456789"
ADMIN_KEY = "sk-admin-0123456789"
COMPLETION = {"model": MODEL, "prompt": "a bb", "max_tokens": 3}


@pytest.fixture(scope="module")
def fake_llm():
    llm = AsyncLLM(FakeEngine(step_delay_s=0.02))
    llm.start()
    yield llm
    llm.shutdown()


def run(app, calls):
    async def main():
        transport = httpx.ASGITransport(app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test", timeout=30) as client:
            return await calls(client)

    return asyncio.run(main())


def bearer(key: str) -> dict:
    return {"Authorization": f"Bearer {key}"}


AUTH_TABLE = [
    # (policy keys, method, path, headers, expected status)
    ((API_KEY, ADMIN_KEY), "GET", "/v1/models", {}, 401),
    ((API_KEY, ADMIN_KEY), "GET", "/v1/models", bearer("sk-wrong-0123456789"), 401),
    ((API_KEY, ADMIN_KEY), "GET", "/v1/models", {"Authorization": API_KEY}, 401),  # no scheme
    ((API_KEY, ADMIN_KEY), "GET", "/v1/models", bearer(API_KEY), 200),
    ((API_KEY, ADMIN_KEY), "GET", "/v1/models", bearer(ADMIN_KEY), 401),  # keys are not interchangeable
    ((API_KEY, ADMIN_KEY), "POST", "/admin/drain?timeout_s=0", bearer(API_KEY), 401),
    ((API_KEY, ADMIN_KEY), "POST", "/admin/drain?timeout_s=0", bearer(ADMIN_KEY), 200),
    ((API_KEY, ADMIN_KEY), "GET", "/health", {}, 200),
    ((API_KEY, ADMIN_KEY), "GET", "/ready", {}, 200),
    ((API_KEY, ADMIN_KEY), "GET", "/metrics", {}, 200),
    ((API_KEY, None), "POST", "/admin/drain?timeout_s=0", {}, 401),  # no admin key: the API key guards /admin
    ((API_KEY, None), "POST", "/admin/drain?timeout_s=0", bearer(API_KEY), 200),
    ((None, ADMIN_KEY), "GET", "/v1/models", {}, 200),
    ((None, ADMIN_KEY), "POST", "/admin/drain?timeout_s=0", {}, 401),
    ((None, None), "POST", "/admin/drain?timeout_s=0", {}, 200),
    # The API's description maps every route and bound: the admin key's, when keys are set.
    ((API_KEY, ADMIN_KEY), "GET", "/openapi.json", {}, 401),
    ((API_KEY, ADMIN_KEY), "GET", "/openapi.json", bearer(API_KEY), 401),
    ((API_KEY, ADMIN_KEY), "GET", "/openapi.json", bearer(ADMIN_KEY), 200),
    ((API_KEY, ADMIN_KEY), "GET", "/docs", {}, 401),
    ((API_KEY, ADMIN_KEY), "GET", "/redoc", bearer(ADMIN_KEY), 200),
    ((API_KEY, None), "GET", "/docs", bearer(API_KEY), 200),
    ((None, None), "GET", "/openapi.json", {}, 200),
]


@pytest.mark.parametrize("keys, method, path, headers, status", AUTH_TABLE)
def test_auth_table(fake_llm, keys, method, path, headers, status):
    app = build_app(fake_llm, MODEL, AccessPolicy(api_key=keys[0], admin_key=keys[1]))
    r = run(app, lambda c: c.request(method, path, headers=headers))
    assert r.status_code == status, r.text
    if status == 401:
        error = r.json()["error"]
        assert error["type"] == "AuthenticationError" and error["code"] == 401
        assert r.headers["www-authenticate"] == "Bearer"
        assert API_KEY not in r.text and ADMIN_KEY not in r.text


def test_completion_with_key_and_unauthorised_ones_are_counted(fake_llm):
    app = build_app(fake_llm, MODEL, AccessPolicy(api_key=API_KEY))

    async def calls(c):
        ok = await c.post("/v1/completions", json=COMPLETION, headers=bearer(API_KEY))
        denied = await c.post("/v1/completions", json=COMPLETION)
        metrics = await c.get("/metrics")
        return ok, denied, metrics

    ok, denied, metrics = run(app, calls)
    assert ok.status_code == 200 and ok.json()["choices"][0]["text"] == "w0 w1 w2 "
    assert denied.status_code == 401
    assert 'elasticmoe_http_requests_total{endpoint="/v1/completions",status="401"} 1.0' in metrics.text


def test_size_limits(fake_llm):
    app = build_app(fake_llm, MODEL, AccessPolicy(max_body_bytes=2048, max_header_bytes=2048))
    big_prompt = {**COMPLETION, "prompt": "x" * 4000}

    async def chunked():  # no Content-Length: counted as it streams in
        yield b'{"model": "fake", "prompt": "'
        for _ in range(10):
            yield b"y" * 500
        yield b'"}'

    async def calls(c):
        by_length = await c.post("/v1/completions", json=big_prompt)
        by_stream = await c.post("/v1/completions", content=chunked(), headers={"Content-Type": "application/json"})
        headers = await c.get("/v1/models", headers={"X-Junk": "z" * 3000})
        small = await c.post("/v1/completions", json=COMPLETION)
        return by_length, by_stream, headers, small

    by_length, by_stream, headers, small = run(app, calls)
    assert by_length.status_code == 413 and by_length.json()["error"]["code"] == 413
    assert by_stream.status_code == 413
    assert headers.status_code == 431
    assert small.status_code == 200


def test_small_chunked_body_is_replayed(fake_llm):
    app = build_app(fake_llm, MODEL)

    async def body():
        yield b'{"model": "fake", "prompt": "a bb", '
        yield b'"max_tokens": 2}'

    r = run(app, lambda c: c.post("/v1/completions", content=body(), headers={"Content-Type": "application/json"}))
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2


@pytest.mark.parametrize("bad", [{"api_key": "short"}, {"admin_key": " padded-key-123 "}, {"max_body_bytes": 10}])
def test_policy_rejects_bad_settings(bad):
    with pytest.raises(ValueError, match="--"):
        AccessPolicy(**bad)


def test_keys_never_in_repr_or_logs(fake_llm, caplog):
    policy = AccessPolicy(api_key=API_KEY, admin_key=ADMIN_KEY)
    assert API_KEY not in repr(policy) and ADMIN_KEY not in repr(policy)
    caplog.set_level(logging.DEBUG)
    app = build_app(fake_llm, MODEL, policy)
    run(app, lambda c: c.get("/v1/models", headers=bearer("sk-wrong-0123456789")))
    run(app, lambda c: c.get("/v1/models", headers=bearer(API_KEY)))
    assert all(API_KEY not in r.getMessage() and "sk-wrong" not in r.getMessage() for r in caplog.records)


def test_drain_refuses_new_requests_and_waits_for_streams(fake_llm):
    drainer = Drainer()
    app = build_app(fake_llm, MODEL, drainer=drainer, drain_timeout_s=30)

    async def calls(c):
        long = asyncio.create_task(c.post("/v1/completions", json={**COMPLETION, "max_tokens": 40, "stream": True}))
        while drainer.in_flight == 0:
            await asyncio.sleep(0.01)
        drain = asyncio.create_task(c.post("/admin/drain", params={"timeout_s": 30}))
        while not drainer.is_draining:
            await asyncio.sleep(0.01)
        refused = await c.post("/v1/completions", json=COMPLETION)
        ready, health = await c.get("/ready"), await c.get("/health")
        assert not drain.done()  # the stream is still running
        return await long, await drain, refused, ready, health

    long, drain, refused, ready, health = run(app, calls)
    assert long.status_code == 200 and long.text.endswith("data: [DONE]\n\n")
    assert '"finish_reason":"length"' in long.text  # finished in full (40 tokens), not cut off
    assert drain.status_code == 200 and drain.json()["drained"] is True and drain.json()["in_flight"] == 0
    assert drain.json()["refused"] == 1
    assert refused.status_code == 503 and refused.headers["retry-after"] == "1"
    assert ready.status_code == 503 and health.status_code == 200


def test_drain_times_out_with_requests_in_flight(fake_llm):
    drainer = Drainer()
    app = build_app(fake_llm, MODEL, drainer=drainer)

    async def calls(c):
        long = asyncio.create_task(c.post("/v1/completions", json={**COMPLETION, "max_tokens": 60}))
        while drainer.in_flight == 0:
            await asyncio.sleep(0.01)
        result = await c.post("/admin/drain", params={"timeout_s": 0.1})
        await long
        return result

    result = run(app, calls).json()
    assert result["drained"] is False and result["in_flight"] == 1


def test_drain_timeout_is_validated(fake_llm):
    r = run(build_app(fake_llm, MODEL), lambda c: c.post("/admin/drain", params={"timeout_s": -1}))
    assert r.status_code == 400 and r.json()["error"]["param"] == "timeout_s"
