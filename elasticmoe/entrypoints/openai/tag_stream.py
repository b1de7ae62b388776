"""What a stream of model text holds back while a tag may be arriving (Hermes' `<tool_call>`, a
reasoning model's `</think>`): the end of the text that could be the tag's start."""

from __future__ import annotations


def partial_tag(text: str, tag: str) -> int:
    """The length of the longest end of `text` that `tag` starts with (0: none; never the whole tag)."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0
