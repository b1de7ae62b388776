"""The single-process server with a real engine, in this process, and a client for it (httpx's
ASGI transport: it reads a whole answer, so a client leaving mid-stream is tested over a real
socket instead, in tests/e2e/test_single_server.py)."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Iterator
from typing import Any

import httpx
import torch

from elasticmoe.config import EngineConfig
from elasticmoe.engine.async_llm import AsyncLLM
from elasticmoe.engine.llm_engine import LLMEngine
from elasticmoe.entrypoints.openai.api_server import build_app


@contextlib.contextmanager
def serving(model_dir: str, served_name: str) -> Iterator[Any]:
    """The app of an fp32 engine on `model_dir`, its loop running; stopped on exit."""
    llm = AsyncLLM(LLMEngine(EngineConfig(model=model_dir, dtype=torch.float32)))
    llm.start()
    try:
        yield build_app(llm, served_name)
    finally:
        llm.shutdown()


def request(app: Any, method: str, path: str, body: dict | None = None) -> httpx.Response:
    async def main() -> httpx.Response:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t", timeout=60) as c:
            return await c.request(method, path, json=body)

    return asyncio.run(main())


def post(app: Any, path: str, body: dict) -> httpx.Response:
    return request(app, "POST", path, body)


def get(app: Any, path: str) -> httpx.Response:
    return request(app, "GET", path)


def sse_events(response: httpx.Response) -> list[dict]:
    """The JSON events of a streamed answer, without the closing `[DONE]`."""
    return [json.loads(line[6:]) for line in response.text.splitlines()
            if line.startswith("data: ") and line != "data: [DONE]"]
