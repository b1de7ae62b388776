"""Prefix caching seen from the single-process server: per request in `usage`, and in
`/admin/status` and `/metrics`."""

from __future__ import annotations

import pytest

from tests.in_process_server import get, post, serving

MODEL = "tiny"
SYSTEM = "You are a terse assistant for the operations team. Answer in one short line, no preamble. " * 2


@pytest.fixture(scope="module")
def app(tiny_model_dir):
    with serving(tiny_model_dir, MODEL) as app:
        yield app


def chat(app, question: str) -> dict:
    body = {"model": MODEL, "max_tokens": 4, "temperature": 0,
            "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]}
    r = post(app, "/v1/chat/completions", body)
    assert r.status_code == 200, r.text
    return r.json()["usage"]


def test_a_shared_system_prompt_is_reported_cached_and_counted(app):
    first = chat(app, "status of the router?")
    assert first["prompt_tokens_details"] == {"cached_tokens": 0}
    second = chat(app, "and of the ingress?")
    cached = second["prompt_tokens_details"]["cached_tokens"]
    assert cached > 0 and cached % 16 == 0 and cached < second["prompt_tokens"]  # whole blocks of the system prompt

    body = get(app, "/admin/status").json()
    assert body["compute"]["dense_weight_dtype"] == body["compute"]["expert_weight_dtype"] == "float32"  # as held
    status = body["kv_cache"]
    assert status["prefix_caching"] and status["cached_blocks"] > 0
    assert status["prefix_cache_hits"] == cached
    assert status["prefix_cache_queries"] == first["prompt_tokens"] + second["prompt_tokens"]
    assert status["free_blocks"] == status["blocks"]  # nothing runs: cached blocks are free blocks

    metrics = get(app, "/metrics").text
    assert f"elasticmoe_prefix_cache_hits_total {float(cached)}" in metrics
    assert "elasticmoe_prefix_cache_queries_total" in metrics and "elasticmoe_kv_cache_usage_ratio 0.0" in metrics
