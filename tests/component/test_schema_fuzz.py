"""Schemathesis over every route of the single-process server (real engine, in-process ASGI):
positive and negative requests generated from the server's own OpenAPI document, and not one
answer of 500 or above; the engine serves normally afterwards.

The engine's context is short (64 tokens), so an accepted request generates a few tokens at
most. `POST /admin/drain` is left out: draining answers every later request 503, by design.
The elastic server's routes are fuzzed over HTTP in tests/e2e/test_elastic_server_api.py.
"""

from __future__ import annotations

import pytest
import schemathesis
import torch
from schema_fuzz import CONFIG, fuzz

from elasticmoe.config import EngineConfig
from elasticmoe.engine.async_llm import AsyncLLM
from elasticmoe.engine.llm_engine import LLMEngine
from elasticmoe.entrypoints.openai.api_server import build_app

MODEL = "tiny-qwen3-moe"


@pytest.fixture(scope="module")
def llm(tiny_model_dir):
    engine = LLMEngine(EngineConfig(model=tiny_model_dir, dtype=torch.float32, max_model_len=64,
                                    max_esft_adapters=1, max_esft_experts=4))
    async_llm = AsyncLLM(engine)
    async_llm.start()
    yield async_llm
    async_llm.shutdown()


def test_no_request_gets_a_server_error(llm):
    schema = schemathesis.openapi.from_asgi("/openapi.json", build_app(llm, MODEL), config=CONFIG).exclude(path="/admin/drain")

    def engine_still_serves() -> None:
        assert llm.is_ready and llm.num_step_failures == 0

    calls = fuzz(schema, max_examples=80, after_each=engine_still_serves)
    assert {k.rsplit(" ", 1)[0] for k in calls} >= {"POST /v1/completions", "POST /v1/chat/completions",
                                                     "GET /v1/models", "POST /admin/adapters", "GET /health"}
    assert sum(calls.values()) > 400, calls
