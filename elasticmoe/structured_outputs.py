"""Structured outputs: an answer constrained to a JSON schema, a regular expression, one of a list
of strings, or a grammar (Lark, or GBNF as vLLM's default backend and llama.cpp read it): OpenAI's
`response_format`, vLLM's `structured_outputs` and `guided_*` fields.

A `StructuredOutputs` is the request's side: what was asked, as llguidance's grammar, checked at
construction so that a bad schema or regex is a 400 naming the field it came in. The engine's
side (a matcher per request that masks the tokens the grammar forbids, `engine.structured_output`)
compiles it against the model's tokenizer. llguidance (vLLM's `guidance` backend uses it) needs
no PyTorch, so the elastic server's ingress checks requests without it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Literal

import llguidance
from llguidance.gbnf_to_lark import any_to_lark

from elasticmoe.errors import InvalidRequestError

# Bounds of what a request may ask for: a grammar is compiled per request, and its size is what
# the compile and each token's mask cost.
MAX_SPEC_CHARS = 1 << 16  # a schema (as JSON text), a regex or a grammar
MAX_CHOICES = 256
MAX_CHOICE_CHARS = 1024

Kind = Literal["json", "json_object", "regex", "choice", "grammar"]
KINDS: tuple[str, ...] = ("json", "json_object", "regex", "choice", "grammar")


def parser_limits() -> llguidance.LLParserLimits:
    """What one grammar may cost the engine, tighter than llguidance's defaults (a mask step's
    lexer fuel 200k, ~14 ms; 250k lexer states, ~0.5 GB): a request's grammar is worked on the
    engine's thread between forwards, so its worst step is every other request's stall. Measured
    here: `(x{1000}){1000}` took 1.35 s for its first mask under the defaults before failing."""
    return llguidance.LLParserLimits(initial_lexer_fuel=200_000, step_lexer_fuel=50_000, step_max_items=20_000,
                                     max_lexer_states=20_000, max_grammar_size=100_000, verbose_errors=False)


# JSON answers as compact as the schema allows (no free whitespace between tokens): a model that
# may emit whitespace forever inside an object otherwise can run to max_tokens without closing it.
_JSON_OPTIONS: dict[str, Any] = {"whitespace_flexible": False}


def _lark_literal(text: str) -> str:
    """`text` as a Lark string literal (JSON's escapes are Lark's)."""
    return json.dumps(text, ensure_ascii=False)


@dataclass(frozen=True, slots=True)
class StructuredOutputs:
    """What the answer must match. `kind` and `spec`: a JSON schema (`spec` its JSON text), any JSON
    object (`json_object`, no spec), a regex, a list of choices (`spec` their JSON list) or a grammar
    (Lark or GBNF). `field`: the request field it came in, which errors name."""

    kind: Kind
    spec: str = ""
    field: str = "structured_outputs"

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise InvalidRequestError(self.field, f"unknown kind {self.kind!r}; one of {', '.join(KINDS)}")
        if len(self.spec) > MAX_SPEC_CHARS:
            raise InvalidRequestError(self.field, f"at most {MAX_SPEC_CHARS} characters, got {len(self.spec)}")
        try:
            error = llguidance.LLMatcher.validate_grammar(self.grammar, limits=parser_limits())
        except Exception as exc:  # noqa: BLE001 - what the converters raise on input they cannot read
            error = str(exc) or type(exc).__name__
        if error:
            raise InvalidRequestError(self.field, f"is not a valid {self._what}: {error.strip()[:500]}")

    @classmethod
    def json_schema(cls, schema: Any, field: str) -> StructuredOutputs:
        """A JSON schema given as an object or as its JSON text."""
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except ValueError as exc:
                raise InvalidRequestError(field, f"is not valid JSON: {exc}") from None
        if not isinstance(schema, dict):
            raise InvalidRequestError(field, f"a JSON schema must be an object, got {type(schema).__name__}")
        try:
            text = json.dumps(schema, ensure_ascii=False)
        except RecursionError:
            raise InvalidRequestError(field, "the JSON schema is nested too deeply") from None
        return cls("json", text, field)

    @classmethod
    def choice(cls, choices: Any, field: str) -> StructuredOutputs:
        if not isinstance(choices, list) or not choices or not all(isinstance(c, str) for c in choices):
            raise InvalidRequestError(field, "must be a non-empty list of strings")
        if len(choices) > MAX_CHOICES:
            raise InvalidRequestError(field, f"at most {MAX_CHOICES} choices, got {len(choices)}")
        if any(not 1 <= len(c) <= MAX_CHOICE_CHARS for c in choices):
            raise InvalidRequestError(field, f"each choice must have 1 to {MAX_CHOICE_CHARS} characters")
        return cls("choice", json.dumps(choices, ensure_ascii=False), field)

    @classmethod
    def text(cls, kind: Literal["regex", "grammar"], spec: Any, field: str) -> StructuredOutputs:
        if not isinstance(spec, str) or not spec:
            raise InvalidRequestError(field, "must be a non-empty string")
        return cls(kind, spec, field)

    @property
    def _what(self) -> str:
        return {"json": "JSON schema", "json_object": "JSON object request", "regex": "regular expression",
                "choice": "list of choices", "grammar": "grammar (Lark or GBNF)"}[self.kind]

    @property
    def grammar(self) -> str:
        """llguidance's grammar for this constraint (what `LLMatcher` takes)."""
        grammar_from = llguidance.LLMatcher
        if self.kind == "json":
            return grammar_from.grammar_from_json_schema(self.spec, defaults=_JSON_OPTIONS)  # type: ignore[arg-type]
        if self.kind == "json_object":
            return grammar_from.grammar_from_json_schema({"type": "object"}, defaults=_JSON_OPTIONS)  # type: ignore[arg-type]
        if self.kind == "regex":
            return grammar_from.grammar_from_regex(self.spec)
        if self.kind == "choice":
            alternatives = " | ".join(_lark_literal(c) for c in json.loads(self.spec))
            return grammar_from.grammar_from_lark(f"start: {alternatives}")
        return grammar_from.grammar_from_lark(any_to_lark(self.spec))  # GBNF (vLLM's xgrammar, llama.cpp) too
