"""The Hermes tool-call format (Qwen2.5/Qwen3, Hermes and others write it; vLLM's `hermes`
parser reads it): a call is `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` inside the
answer's text, any number of them.

`parse` reads a whole answer; `HermesStream` reads one as it is generated and says, for each new
piece of text, what is content for the client and which calls have closed. A call that does not
parse (not JSON, no name) stays in the content as the model wrote it, so nothing is lost.
"""

from __future__ import annotations

import json
import re
from typing import Any

from elasticmoe.entrypoints.openai.tag_stream import partial_tag

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_CALL = re.compile(re.escape(OPEN) + r"(.*?)" + re.escape(CLOSE), re.S)


def uses_hermes(chat_template: str | None) -> bool:
    """Whether a chat template asks the model for Hermes calls (it shows the tag)."""
    return chat_template is not None and OPEN in chat_template


def _call(body: str) -> tuple[str, str] | None:
    """(name, arguments as JSON text) of one call's body, or None if it is not a call."""
    try:
        obj: Any = json.loads(body)
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    arguments = obj.get("arguments", obj.get("parameters", {}))
    return obj["name"], arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)


def parse(text: str) -> tuple[str, list[tuple[str, str]]]:
    """(content, calls) of a whole answer: the text without the calls that parse, stripped."""
    calls: list[tuple[str, str]] = []

    def take(match: re.Match[str]) -> str:
        call = _call(match.group(1))
        if call is None:
            return match.group(0)
        calls.append(call)
        return ""

    return _CALL.sub(take, text).strip(), calls


class HermesStream:
    """An answer's text piece by piece -> content to send now and calls that closed. Text that may
    be the start of `<tool_call>` is held back until it is not; a call's text is held until it
    closes (or the answer ends: an unclosed call goes out as content)."""

    def __init__(self) -> None:
        self._pending = ""  # held back: a possible tag start, or an open call's text

    def feed(self, text: str, finished: bool) -> tuple[str, list[tuple[str, str]]]:
        self._pending += text
        content, calls = "", list[tuple[str, str]]()
        while True:
            start = self._pending.find(OPEN)
            if start < 0:
                break
            end = self._pending.find(CLOSE, start)
            if end < 0:
                content += self._pending[:start]
                self._pending = self._pending[start:]
                return (content + self._pending, calls) if finished else (content, calls)
            content += self._pending[:start]
            whole = self._pending[start : end + len(CLOSE)]
            self._pending = self._pending[end + len(CLOSE) :]
            call = _call(whole[len(OPEN) : -len(CLOSE)])
            if call is None:
                content += whole
            else:
                calls.append(call)
        if finished:
            content, self._pending = content + self._pending, ""
            return content, calls
        keep = partial_tag(self._pending, OPEN)
        content += self._pending[: len(self._pending) - keep]
        self._pending = self._pending[len(self._pending) - keep :]
        return content, calls
