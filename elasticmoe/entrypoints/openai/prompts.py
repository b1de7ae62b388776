"""Prompts to token ids, off the event loop and off the engine thread, bounded in size.

Tokenizing a long prompt or rendering a chat template takes CPU time proportional to its
length (a 3.9 MB prompt took 6-9 s). Done on the HTTP event loop it stalls every other
request and the health probes; done on the engine thread it stalls every stream. Here it
runs on a small pool of its own threads (the tokenizers release the GIL while they work),
and a prompt with more characters than the context could possibly hold is refused before
any work: `max_chars_per_token` characters per token of the context is far beyond what a
real tokenizer produces, so nothing that fits is refused.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from elasticmoe.errors import InvalidRequestError

T = TypeVar("T")

DEFAULT_MAX_CHARS_PER_TOKEN = 64
DEFAULT_WORKERS = 2


class PromptRenderer:
    """`tokenizer` has `encode(text, add_special_tokens)` and `apply_chat_template(messages, tools,
    template_kwargs)`;
    `max_model_len()` is the context limit now (it changes with the active instance)."""

    def __init__(
        self,
        tokenizer: Any,
        max_model_len: Callable[[], int],
        max_chars_per_token: int = DEFAULT_MAX_CHARS_PER_TOKEN,
        workers: int = DEFAULT_WORKERS,
    ) -> None:
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.max_chars_per_token = max_chars_per_token
        self._pool = ThreadPoolExecutor(workers, thread_name_prefix="tokenize")

    def max_chars(self) -> int:
        return self.max_model_len() * self.max_chars_per_token

    def _check_size(self, num_chars: int, param: str) -> None:
        limit = self.max_chars()
        if num_chars > limit:
            raise InvalidRequestError(
                param, f"has {num_chars} characters; the {self.max_model_len()}-token context holds at most "
                f"{limit} ({self.max_chars_per_token} per token)",
            )

    async def run(self, fn: Callable[[], T]) -> T:
        """`fn()` on this pool's threads: CPU work that must not stall the event loop."""
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn)

    async def completion(self, prompt: str | list[int]) -> list[int]:
        """Token ids of a completion prompt (ids pass through unchanged)."""
        if not isinstance(prompt, str):
            return prompt
        self._check_size(len(prompt), "prompt")
        ids = await self.run(lambda: list(self.tokenizer.encode(prompt)))
        if not ids:
            raise InvalidRequestError("prompt", "must not be empty")
        return ids

    async def chat(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None,
                   template_kwargs: dict[str, Any] | None = None) -> list[int]:
        """Token ids of `messages` rendered with the chat template (the assistant turn opened), with
        `tools` for the template to show and `template_kwargs` as its further variables."""
        self._check_size(sum(len(m["content"]) + len(m["role"]) + len(json.dumps(m.get("tool_calls") or []))
                             for m in messages), "messages")
        if tools:
            self._check_size(len(json.dumps(tools)), "tools")
        if template_kwargs:
            self._check_size(len(json.dumps(template_kwargs)), "chat_template_kwargs")
        return await self.run(lambda: list(self.tokenizer.apply_chat_template(messages, tools, template_kwargs)))

    async def bad_words(self, words: list[str]) -> list[list[int]]:
        """vLLM's tokenization of `bad_words`: each word as it starts a text and after a space (as
        it appears mid-text), without special tokens; the same sequence once."""
        def encode() -> list[list[int]]:
            sequences: list[list[int]] = []
            for word in words:
                for text in (word.lstrip(), " " + word.lstrip()):
                    ids = list(self.tokenizer.encode(text, add_special_tokens=False))
                    if ids and ids not in sequences:
                        sequences.append(ids)
            return sequences

        return await self.run(encode)

    def chat_template(self) -> str | None:
        """The model's chat template text (None: it has none, or the tokenizer does not say)."""
        template = getattr(getattr(self.tokenizer, "hf", None), "chat_template", None)
        return template if isinstance(template, str) else None

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
