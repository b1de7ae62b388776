"""Tokenizer (HF `tokenizer.json` via transformers, loaded locally) and incremental detokenizer."""

from __future__ import annotations

import json
from pathlib import Path

from elasticmoe.errors import InvalidRequestError

# Tokens of the prompt tail decoded together with the first output tokens, so
# that tokenizers which merge across token boundaries (SentencePiece spaces)
# produce the right first characters.
_PREFIX_WINDOW = 5


class Tokenizer:
    def __init__(self, model_dir: str | Path) -> None:
        from transformers import AutoTokenizer

        self.hf = AutoTokenizer.from_pretrained(str(model_dir))
        self.eos_token_ids = self._eos_ids(Path(model_dir))
        self.vocab_size = len(self.hf)

    def _eos_ids(self, model_dir: Path) -> tuple[int, ...]:
        ids: set[int] = set()
        for name in ("generation_config.json", "config.json"):
            path = model_dir / name
            if path.is_file():
                eos = json.loads(path.read_text()).get("eos_token_id")
                ids.update(eos if isinstance(eos, list) else [] if eos is None else [eos])
        if self.hf.eos_token_id is not None:
            ids.add(self.hf.eos_token_id)
        return tuple(sorted(ids))

    def encode(self, text: str) -> list[int]:
        return list(self.hf.encode(text))

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return str(self.hf.decode(ids, skip_special_tokens=skip_special_tokens))

    def token_text(self, token_id: int) -> str:
        return str(self.hf.decode([token_id]))

    def apply_chat_template(self, messages: list[dict]) -> list[int]:
        """Render messages with the model's chat template, opening the assistant turn."""
        if not self.hf.chat_template:
            raise InvalidRequestError("messages", "this model has no chat template; use /v1/completions")
        text = self.hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        # The template already contains any special tokens it wants.
        return list(self.hf.encode(text, add_special_tokens=False))


class IncrementalDetokenizer:
    """Turns a growing token list into text deltas, never emitting half a UTF-8 character."""

    def __init__(self, tokenizer: Tokenizer, prompt_ids: list[int], skip_special_tokens: bool) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids = list(prompt_ids[-_PREFIX_WINDOW:])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)

    def add(self, token_id: int) -> str:
        self.ids.append(token_id)
        decode = self.tokenizer.decode
        prefix = decode(self.ids[self.prefix_offset : self.read_offset], self.skip_special_tokens)
        full = decode(self.ids[self.prefix_offset :], self.skip_special_tokens)
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return ""  # an incomplete character: wait for more bytes
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        return full[len(prefix) :]
