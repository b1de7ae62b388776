"""Prompts become token ids on the renderer's threads, bounded in size: no prompt stalls the others."""

from __future__ import annotations

import asyncio
import threading

import httpx
import pytest
from fake_engine import FakeEngine, FakeTokenizer

from elasticmoe.engine.async_llm import AsyncLLM
from elasticmoe.entrypoints.openai.api_server import build_app
from elasticmoe.entrypoints.openai.prompts import PromptRenderer
from elasticmoe.errors import InvalidRequestError


class _Refusing(FakeTokenizer):
    def encode(self, text: str) -> list[int]:
        raise AssertionError("an oversized prompt must be refused before it is tokenized")

    def apply_chat_template(self, messages: list[dict], tools: list[dict] | None = None,
                            template_kwargs: dict | None = None) -> list[int]:
        raise AssertionError("an oversized conversation must be refused before it is rendered")


def test_oversized_prompts_are_refused_before_any_work():
    renderer = PromptRenderer(_Refusing(), lambda: 100, max_chars_per_token=4)

    async def main() -> None:
        with pytest.raises(InvalidRequestError) as info:
            await renderer.completion("x" * 401)
        assert info.value.param == "prompt" and "401 characters" in str(info.value)
        with pytest.raises(InvalidRequestError) as info:
            await renderer.chat([{"role": "user", "content": "x" * 400}])
        assert info.value.param == "messages"
        assert await renderer.completion([1, 2, 3]) == [1, 2, 3]  # token ids pass through

    asyncio.run(main())
    renderer.shutdown()


class _Slow(FakeTokenizer):
    """Blocks on `release` when asked for the text "slow"."""

    def __init__(self) -> None:
        self.entered, self.release = threading.Event(), threading.Event()

    def encode(self, text: str) -> list[int]:
        if text == "slow":
            self.entered.set()
            assert self.release.wait(10)
        return super().encode(text)


def test_a_slow_prompt_stalls_neither_the_event_loop_nor_the_engine():
    engine = FakeEngine()
    tokenizer = engine.tokenizer = _Slow()
    llm = AsyncLLM(engine)
    llm.start()
    app = build_app(llm, "fake")

    async def main() -> None:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test", timeout=20) as c:
            slow = asyncio.create_task(c.post("/v1/completions", json={"model": "fake", "prompt": "slow"}))
            await asyncio.to_thread(tokenizer.entered.wait, 10)
            # While that prompt is being tokenized: the probes answer and other requests run to the end.
            assert (await c.get("/health")).status_code == 200
            other = await c.post("/v1/completions", json={"model": "fake", "prompt": "a bb", "max_tokens": 3})
            assert other.status_code == 200 and other.json()["usage"]["completion_tokens"] == 3
            assert not slow.done()
            tokenizer.release.set()
            assert (await slow).status_code == 200

    asyncio.run(main())
    llm.shutdown()
