"""The bad-input table against the single-process server with a real engine, in-process.

Each case gets its exact 4xx in OpenAI's format, the engine loop stays healthy after
every one, and a normal request afterwards generates exactly what it generated before.
"""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest
from bad_inputs import CASES, MODEL, check_error
from in_process_server import serving

GREEDY = {"model": MODEL, "prompt": "the expert model", "max_tokens": 8, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def app(tiny_model_dir):
    with serving(tiny_model_dir, MODEL) as app:
        yield app


async def _send(client: httpx.AsyncClient, method: str, path: str, body) -> httpx.Response:
    if isinstance(body, bytes):
        return await client.request(method, path, content=body, headers={"content-type": "application/json"})
    return await client.request(method, path, json=body) if body is not None else await client.request(method, path)


def test_every_bad_input_gets_its_4xx_and_the_engine_serves_on(app):
    async def main() -> list[str]:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test", timeout=60) as c:
            before = (await c.post("/v1/completions", json=GREEDY)).json()["choices"][0]["text"]
            failures = []
            for case in CASES:
                _, method, path, body, _, _ = case
                r = await _send(c, method, path, body)
                try:
                    check_error(case, r.status_code, r.json())
                except (AssertionError, json.JSONDecodeError) as exc:
                    failures.append(f"{case[0]}: {exc} ({r.status_code} {r.text[:200]!r})\n")
                health = await c.get("/health")
                assert health.status_code == 200, f"{case[0]} left the engine unhealthy"
            after = (await c.post("/v1/completions", json=GREEDY)).json()["choices"][0]["text"]
            assert after == before
            return failures

    assert len(CASES) >= 100
    failures = asyncio.run(main())
    assert not failures, "".join(failures)


def test_openapi_states_the_bounds_and_400_not_422(app):
    async def main() -> dict:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as c:
            return (await c.get("/openapi.json")).json()

    schema = asyncio.run(main())
    text = json.dumps(schema)
    assert '"422"' not in text and "HTTPValidationError" not in text
    completion = schema["paths"]["/v1/completions"]["post"]["responses"]
    assert completion["400"]["content"]["application/json"]["schema"] == {"$ref": "#/components/schemas/ErrorResponse"}
    assert "default" in completion
    fields = schema["components"]["schemas"]["CompletionRequest"]["properties"]
    assert fields["top_k"]["maximum"] == 2**31 - 1
    seed = fields["seed"]["anyOf"][0]  # JSON numbers: 2^64 - 1 prints as a float
    assert (float(seed["minimum"]), float(seed["maximum"])) == (float(-(2**63)), float(2**64 - 1))
    assert fields["max_tokens"]["anyOf"][0]["maximum"] == 2**31 - 1
