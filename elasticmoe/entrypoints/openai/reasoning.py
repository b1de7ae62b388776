"""Reasoning models' thinking apart from their answer (`serve --reasoning-parser`, as vLLM's flag).

Qwen3 and DeepSeek-R1 think first: `<think>` ... `</think>`, then the answer. With a parser the
chat API returns the thinking as the message's `reasoning` (vLLM's field; `reasoning_content`,
DeepSeek's name and vLLM's earlier one, carries the same text) and only the answer as `content`.
Both parsers read the answer as thinking from its start (a `<think>` there is dropped: newer
templates put it in the prompt) until `</think>`, and the rest as content. An answer cut short
before `</think>` is all reasoning, its content null.

- `qwen3`: a request that turns thinking off (`chat_template_kwargs: {"enable_thinking": false}`,
  which Qwen3's template takes) is all content;
- `deepseek_r1`: always thinks.

The newlines around each part that the models write (`<think>\\n...\\n</think>\\n\\n`) are not
part of either. `ReasoningStream` splits an answer as it is generated (a possible tag start is
held back until it is not one); `split` is the same for a whole answer.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from elasticmoe.entrypoints.openai.tag_stream import partial_tag

START, END = "<think>", "</think>"
PARSERS = ("qwen3", "deepseek_r1")


def thinks(parser: str | None, chat_template_kwargs: Mapping[str, Any] | None) -> bool:
    """Whether an answer under `parser` starts with thinking."""
    if parser is None:
        return False
    if parser == "qwen3":
        return bool((chat_template_kwargs or {}).get("enable_thinking", True))
    return True


class ReasoningStream:
    """An answer's text piece by piece -> (reasoning, content) to send now."""

    def __init__(self, thinking: bool) -> None:
        self.in_reasoning = thinking
        self._pending = ""  # held back: a possible tag start, or newlines that may end a part
        self._at_start = True  # of the current part: its leading newlines (and a <think>) are dropped

    def feed(self, text: str, finished: bool) -> tuple[str, str]:
        reasoning, content = "", ""
        self._pending += text
        if self.in_reasoning:
            if self._at_start:
                stripped = self._pending.lstrip("\n")
                if START.startswith(stripped) and stripped and not finished:
                    return "", ""  # maybe the start tag: wait
                if stripped.startswith(START):
                    stripped = stripped[len(START) :]
                self._pending = stripped.lstrip("\n")
                if not self._pending and not finished:
                    return "", ""
                self._at_start = False
            end = self._pending.find(END)
            if end < 0:
                if finished:
                    reasoning, self._pending = self._pending.rstrip("\n"), ""
                    return reasoning, ""
                keep = _held_back(self._pending, END)
                reasoning = self._pending[: len(self._pending) - keep]
                self._pending = self._pending[len(self._pending) - keep :]
                return reasoning, ""
            reasoning = self._pending[:end].rstrip("\n")
            self._pending = self._pending[end + len(END) :]
            self.in_reasoning, self._at_start = False, True
        if self._at_start:
            self._pending = self._pending.lstrip("\n")
            if not self._pending:
                return reasoning, ""
            self._at_start = False
        content, self._pending = self._pending, ""
        return reasoning, content


def _held_back(text: str, tag: str) -> int:
    """How much of the end of `text` to hold back: trailing newlines (they end the part if the tag
    follows) and the longest end of `text` that `tag` starts with."""
    partial = partial_tag(text, tag)
    body = text[: len(text) - partial]
    return partial + len(body) - len(body.rstrip("\n"))


def split(text: str, thinking: bool) -> tuple[str | None, str | None]:
    """(reasoning, content) of a whole answer; None for a part it does not have."""
    if not thinking:
        return None, text
    stream = ReasoningStream(thinking)
    reasoning, content = stream.feed(text, finished=True)
    if stream.in_reasoning:  # no </think>: cut short while thinking
        return reasoning, None
    return reasoning, content or None
