"""The request fields that ask for a structured output, read into one `StructuredOutputs`.

Three spellings are accepted, as vLLM's OpenAI server accepts them:
- OpenAI's `response_format`: `{"type": "json_object"}` or `{"type": "json_schema", "json_schema":
  {"name": ..., "schema": {...}}}` (`{"type": "text"}`: none);
- vLLM's `structured_outputs`: `{"json": schema}`, `{"regex": ...}`, `{"choice": [...]}`,
  `{"grammar": a Lark or GBNF grammar}` or `{"json_object": true}`;
- vLLM's older `guided_json`, `guided_regex`, `guided_choice`, `guided_grammar`.

A request asks for at most one; each error names the field it came in.
"""

from __future__ import annotations

from typing import Any

from elasticmoe.entrypoints.openai import not_implemented
from elasticmoe.sampling_params import SamplingParamError
from elasticmoe.structured_outputs import StructuredOutputs

# `structured_outputs` keys and the `StructuredOutputs` they build.
_KEYS = ("json", "regex", "choice", "grammar", "json_object")
# vLLM's options of the same object that this server does not implement: refused unless neutral.
_NEUTRAL_OPTIONS: dict[str, tuple[Any, ...]] = {
    "disable_fallback": (False,), "disable_any_whitespace": (False,), "disable_additional_properties": (False,),
    "whitespace_pattern": (), "structural_tag": (), "backend": (), "_backend": (), "_backend_was_auto": (False,),
}


def _given(fields: dict[str, Any]) -> list[tuple[str, Any]]:
    """The fields that ask for something (a text response format asks for nothing)."""
    return [(name, value) for name, value in fields.items()
            if value is not None and not (name == "response_format" and _is_text(value))]


def asks_for(fields: dict[str, Any]) -> bool:
    """Whether a request's `fields` ask for a structured output (not checked: see `structured_outputs`)."""
    return bool(_given(fields))


def structured_outputs(fields: dict[str, Any]) -> StructuredOutputs | None:
    """The constraint a request's `fields` (name -> value as sent, absent ones None) ask for, or None."""
    given = _given(fields)
    if len(given) > 1:
        raise SamplingParamError(given[1][0], f"only one structured output per request: {given[0][0]} is given too")
    if not given:
        return None
    name, value = given[0]
    if name == "response_format":
        return _response_format(value)
    if name == "structured_outputs":
        return _vllm_structured_outputs(value)
    kind = name.removeprefix("guided_")
    return _build(kind, value, name)


def _is_text(value: Any) -> bool:
    return isinstance(value, dict) and value.get("type") == "text"


def _build(kind: str, value: Any, field: str) -> StructuredOutputs:
    if kind == "json":
        return StructuredOutputs.json_schema(value, field)
    if kind == "choice":
        return StructuredOutputs.choice(value, field)
    if kind in ("regex", "grammar"):
        return StructuredOutputs.text(kind, value, field)  # type: ignore[arg-type]
    raise SamplingParamError(field, f"unknown structured output {kind!r}")


def _response_format(value: Any) -> StructuredOutputs:
    field = "response_format"
    kind = value.get("type") if isinstance(value, dict) else None
    if kind == "json_object":
        return StructuredOutputs("json_object", field=field)
    if kind == "json_schema":
        spec = value.get("json_schema")
        if not isinstance(spec, dict) or "schema" not in spec:
            raise SamplingParamError(field, 'a json_schema response format needs "json_schema": {"name": ..., '
                                     '"schema": {...}}')
        return StructuredOutputs.json_schema(spec["schema"], field)
    raise SamplingParamError(field, f'"type" must be "text", "json_object" or "json_schema", got {str(kind)[:40]!r}')


def _vllm_structured_outputs(value: Any) -> StructuredOutputs | None:
    field = "structured_outputs"
    if not isinstance(value, dict):
        raise SamplingParamError(field, f"must be an object, got {type(value).__name__}")
    not_implemented.refuse(value, _NEUTRAL_OPTIONS, prefix=f"{field}.")
    unknown = sorted(k for k in value if k not in _KEYS and k not in _NEUTRAL_OPTIONS)
    if unknown:
        raise SamplingParamError(f"{field}.{str(unknown[0])[:40]}", f"unknown key; one of {', '.join(_KEYS)}")
    given = [k for k in _KEYS if value.get(k) not in (None, False)]
    if len(given) > 1:
        raise SamplingParamError(field, f"only one of {', '.join(_KEYS)}, got {' and '.join(given)}")
    if not given:
        return None
    if given[0] == "json_object":
        if value["json_object"] is not True:
            raise SamplingParamError(f"{field}.json_object", "must be true or false")
        return StructuredOutputs("json_object", field=field)
    return _build(given[0], value[given[0]], field)
