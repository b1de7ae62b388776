"""Tokenizer (HF `tokenizer.json` via transformers, loaded locally) and incremental detokenizer.

Decoding, which every rank does for every token, runs on the `tokenizers` backend that
transformers itself decodes with, whenever its `decode` is exactly that backend's (true of
the fast tokenizers this project serves; checked, else transformers decodes). The backend is
cached on disk as transformers built it (`$ELASTICMOE_TOKENIZER_CACHE`, default
`~/.cache/elasticmoe/tokenizers`, keyed by the tokenizer files' content and both libraries'
versions), so a process that only decodes (a rank, `encodes=False`) loads it without
importing transformers: that import scans transformers' whole model registry, ~1.3 s of CPU
at every rank start, on the path of a scale-up. A process that encodes loads transformers at
construction, as before, so that its first request does not wait for it. With a cache entry it
loads the tokenizer class `AutoTokenizer` chose when the entry was written, directly: resolving
that class is what imports PyTorch (through transformers' model configs), and the elastic
server's ingress, which encodes every prompt, runs without PyTorch.
"""

from __future__ import annotations

import hashlib
import importlib
import json
import logging
import os
import tempfile
from functools import cached_property
from importlib import metadata
from pathlib import Path
from typing import Any

from elasticmoe.errors import InvalidRequestError
from elasticmoe.utils.user_cache import user_cache_dir

logger = logging.getLogger(__name__)

# Tokens of the prompt tail decoded together with the first output tokens, so
# that tokenizers which merge across token boundaries (SentencePiece spaces)
# produce the right first characters.
_PREFIX_WINDOW = 5
# What a tokenizer may read beside its own files; weights are never hashed.
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".gguf", ".npz", ".h5", ".msgpack", ".onnx")


def _cache_key(model_dir: Path) -> str:
    """The tokenizer's identity: every non-weight file of the model directory and the versions of
    the two libraries that build and run it."""
    digest = hashlib.sha256()
    for lib in ("transformers", "tokenizers"):
        digest.update(f"{lib}={metadata.version(lib)};".encode())
    for path in sorted(model_dir.iterdir()):
        if path.is_file() and not path.name.endswith(_WEIGHT_SUFFIXES):
            digest.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()[:24]


def _decodes_with_backend(hf: Any) -> bool:
    """Whether transformers' `decode` of `hf` is its backend's `decode(ids, skip_special_tokens)`
    and nothing else: the fast tokenizer's own `_decode`, not overridden, with no space cleanup
    applied (transformers skips that cleanup for BPE models)."""
    try:
        from transformers.tokenization_utils_base import PreTrainedTokenizerBase
        from transformers.tokenization_utils_tokenizers import TokenizersBackend
    except ImportError:
        return False
    cls = type(hf)
    if not isinstance(hf, TokenizersBackend) or cls._decode is not TokenizersBackend._decode:
        return False
    if cls.decode is not PreTrainedTokenizerBase.decode:
        return False
    cleanup = bool(getattr(hf, "clean_up_tokenization_spaces", False))
    is_bpe = type(hf.backend_tokenizer.model).__name__ == "BPE"
    forced = bool(getattr(hf, "clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output", False))
    return not cleanup or (is_bpe and not forced)


def _transformers_class(name: Any) -> Any:
    """The tokenizer class a cache entry names (`module:qualname`), or None: only transformers'
    own classes are imported (an entry is a file in the user's cache, not code to run)."""
    if not isinstance(name, str) or not name.startswith("transformers.") or ":" not in name:
        return None
    module, qualname = name.split(":", 1)
    try:
        found: Any = importlib.import_module(module)
        for part in qualname.split("."):
            found = getattr(found, part)
    except (ImportError, AttributeError) as exc:  # another transformers layout: AutoTokenizer decides
        logger.info("tokenizer class %s not found (%s); loading through AutoTokenizer", name, exc)
        return None
    return found if isinstance(found, type) and hasattr(found, "from_pretrained") else None


class Tokenizer:
    def __init__(self, model_dir: str | Path, *, encodes: bool = True) -> None:
        """`encodes=False`: the process only decodes (a rank), so transformers is not loaded when
        the cache has the backend (it still loads on a first `encode`, which is then slow)."""
        self.model_dir = Path(model_dir)
        self._backend: Any = None  # a `tokenizers.Tokenizer` that decodes as transformers does, or None
        cached = self._read_cache()
        self._cached_class = cached.get("hf_class") if cached else None  # what `AutoTokenizer` chose
        self._hf_class: Any = None  # that class, once `hf` resolved it
        if cached is not None and not encodes:
            from tokenizers import Tokenizer as Backend

            self._backend = Backend.from_str(cached["backend"])
            self.eos_token_ids = tuple(cached["eos_token_ids"])
            self.vocab_size = int(cached["vocab_size"])
            return
        hf = self.hf
        self.eos_token_ids = self._eos_ids(hf.eos_token_id)
        self.vocab_size = len(hf)
        if _decodes_with_backend(hf):
            self._backend = hf.backend_tokenizer
            if cached is None or self._hf_class is None:
                self._write_cache()

    @cached_property
    def hf(self) -> Any:
        """The transformers tokenizer (imported and loaded on first use): through `AutoTokenizer`,
        or the class it chose before (the cache's `hf_class`), which gives the same tokenizer."""
        self._hf_class = _transformers_class(self._cached_class)
        if self._hf_class is not None:
            return self._hf_class.from_pretrained(str(self.model_dir))
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(str(self.model_dir))

    def _eos_ids(self, tokenizer_eos: int | None) -> tuple[int, ...]:
        ids: set[int] = set()
        for name in ("generation_config.json", "config.json"):
            path = self.model_dir / name
            if path.is_file():
                eos = json.loads(path.read_text()).get("eos_token_id")
                ids.update(eos if isinstance(eos, list) else [] if eos is None else [eos])
        if tokenizer_eos is not None:
            ids.add(tokenizer_eos)
        return tuple(sorted(ids))

    @cached_property
    def _cache_path(self) -> Path:
        """Hashed once: a miss reads it, then the write after loading through transformers."""
        return user_cache_dir("tokenizers", "ELASTICMOE_TOKENIZER_CACHE") / f"{_cache_key(self.model_dir)}.json"

    def _read_cache(self) -> dict[str, Any] | None:
        try:
            return dict(json.loads(self._cache_path.read_text()))
        except FileNotFoundError:
            return None
        except (OSError, ValueError) as exc:  # unreadable or torn: rebuilt from transformers
            logger.info("tokenizer cache of %s unusable (%s); loading through transformers", self.model_dir, exc)
            return None

    def _write_cache(self) -> None:
        cls = type(self.hf)
        entry = {"backend": self._backend.to_str(), "eos_token_ids": list(self.eos_token_ids),
                 "vocab_size": self.vocab_size, "model_dir": str(self.model_dir),
                 "hf_class": f"{cls.__module__}:{cls.__qualname__}"}
        try:
            path = self._cache_path
            path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(suffix=".json", dir=path.parent)
            with os.fdopen(fd, "w") as f:
                json.dump(entry, f)
            os.replace(tmp, path)  # concurrent writers (ranks starting together) write the same bytes
        except OSError as exc:  # e.g. a read-only home: every process loads through transformers
            logger.info("tokenizer cache not written (%s)", exc)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self.hf.encode(text, add_special_tokens=add_special_tokens))

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        if self._backend is not None:
            return str(self._backend.decode(ids, skip_special_tokens=skip_special_tokens))
        return str(self.hf.decode(ids, skip_special_tokens=skip_special_tokens))

    def backend_json(self) -> str:
        """The `tokenizers` tokenizer as JSON (what llguidance builds its token trie from);
        `InvalidRequestError` for a slow (Python) tokenizer, which has none."""
        backend = self._backend if self._backend is not None else getattr(self.hf, "backend_tokenizer", None)
        if backend is None:
            raise InvalidRequestError("structured_outputs", "structured outputs need a fast (`tokenizers`) "
                                      "tokenizer; this model's is a slow one")
        return str(backend.to_str())

    def token_text(self, token_id: int) -> str:
        return self.decode([token_id], skip_special_tokens=False)

    def apply_chat_template(self, messages: list[dict], tools: list[dict] | None = None,
                            template_kwargs: dict[str, Any] | None = None) -> list[int]:
        """Render messages (and the tools the model may call, for a template that shows them) with
        the model's chat template, opening the assistant turn; `template_kwargs` are more variables
        for the template (a request's `chat_template_kwargs`, e.g. Qwen3's `enable_thinking`)."""
        if not self.hf.chat_template:
            raise InvalidRequestError("messages", "this model has no chat template; use /v1/completions")
        text = self.hf.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=False,
                                           **(template_kwargs or {}))
        # The template already contains any special tokens it wants.
        return list(self.hf.encode(text, add_special_tokens=False))


class IncrementalDetokenizer:
    """Turns a growing token list into text deltas, never emitting half a UTF-8 character.

    Each token decodes a short window of tokens twice, with and without it. A token that adds no
    text to a window with nothing pending (a special token skipped, an id the tokenizer does not
    know) leaves the window as it was: kept, every such token made the window one longer and the
    next token's decodes slower (80 us a token after 4,000 of them, growing without bound)."""

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
        if full == prefix and self.read_offset == len(self.ids) - 1:
            self.ids.pop()  # no text and nothing pending: as if it had not come
            return ""
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return ""  # an incomplete character: wait for more bytes
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        return full[len(prefix) :]
