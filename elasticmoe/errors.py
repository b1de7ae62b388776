"""Errors the engine raises for bad input. Each names the offending field so the
HTTP layer can answer 400 with OpenAI's `param` set."""

from __future__ import annotations


class InvalidRequestError(ValueError):
    def __init__(self, param: str, message: str) -> None:
        super().__init__(f"{param}: {message}")
        self.param = param
        self.message = message
