"""Structured outputs as requests ask for them: the three spellings of the fields read into one
`StructuredOutputs`, and every bad value refused naming the field it came in."""

from __future__ import annotations

import json
import pickle

import pytest

from elasticmoe.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest
from elasticmoe.errors import InvalidRequestError
from elasticmoe.structured_outputs import MAX_SPEC_CHARS, StructuredOutputs

MODEL = "m"
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "x"}]}
COMPLETION = {"model": MODEL, "prompt": "x"}


def _constraint(body: dict, request_class=ChatCompletionRequest) -> StructuredOutputs | None:
    return request_class.model_validate(body).to_sampling_params().structured_outputs


def _refused(body: dict, request_class=ChatCompletionRequest) -> InvalidRequestError:
    with pytest.raises(InvalidRequestError) as info:
        _constraint(body, request_class)
    return info.value


@pytest.mark.parametrize("fields,kind,spec", [
    ({"response_format": {"type": "json_object"}}, "json_object", ""),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": SCHEMA, "strict": True}}},
     "json", SCHEMA),
    ({"structured_outputs": {"json": SCHEMA}}, "json", SCHEMA),
    ({"structured_outputs": {"json": json.dumps(SCHEMA)}}, "json", SCHEMA),
    ({"structured_outputs": {"json_object": True}}, "json_object", ""),
    ({"structured_outputs": {"regex": "[0-9]+", "disable_any_whitespace": False}}, "regex", "[0-9]+"),
    ({"structured_outputs": {"choice": ["a", "b"]}}, "choice", ["a", "b"]),
    ({"structured_outputs": {"grammar": 'start: "x"'}}, "grammar", 'start: "x"'),
    ({"guided_json": SCHEMA}, "json", SCHEMA),
    ({"guided_regex": "[0-9]+"}, "regex", "[0-9]+"),
    ({"guided_choice": ["a", "b"]}, "choice", ["a", "b"]),
    ({"guided_grammar": 'start: "x"'}, "grammar", 'start: "x"'),
    # a text response format asks for nothing, beside another field too
    ({"response_format": {"type": "text"}, "guided_regex": "a"}, "regex", "a"),
])
@pytest.mark.parametrize("request_class,body", [(ChatCompletionRequest, CHAT), (CompletionRequest, COMPLETION)])
def test_each_spelling_reads_into_one_constraint(request_class, body, fields, kind, spec):
    constraint = _constraint({**body, **fields}, request_class)
    assert constraint is not None and constraint.kind == kind
    if kind in ("json", "choice"):
        assert json.loads(constraint.spec) == spec
    elif kind != "json_object":
        assert constraint.spec == spec
    assert constraint.field == next(iter(f for f in fields if f != "response_format" or len(fields) == 1))
    assert pickle.loads(pickle.dumps(constraint)) == constraint  # crosses to the ranks as it is


@pytest.mark.parametrize("fields", [{}, {"response_format": {"type": "text"}}, {"structured_outputs": {}},
                                    {"structured_outputs": {"json_object": False}}, {"guided_json": None}])
def test_nothing_asked_is_no_constraint(fields):
    assert _constraint({**CHAT, **fields}) is None


@pytest.mark.parametrize("fields,param,says", [
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "nonsense"}}}},
     "response_format", "not a valid JSON schema"),
    ({"response_format": {"type": "json_schema"}}, "response_format", "needs"),
    ({"response_format": {"type": "xml"}}, "response_format", '"type" must be'),
    ({"guided_json": "{not json"}, "guided_json", "not valid JSON"),
    ({"guided_json": "[1, 2]"}, "guided_json", "must be an object"),
    ({"guided_regex": "[a-"}, "guided_regex", "not a valid regular expression"),
    ({"guided_regex": ""}, "guided_regex", "non-empty"),
    ({"guided_grammar": "start: undefined_rule"}, "guided_grammar", "not a valid grammar"),
    ({"guided_grammar": "root ::= missing"}, "guided_grammar", "not a valid grammar"),
    ({"guided_choice": []}, "guided_choice", "non-empty list"),
    ({"guided_choice": [""]}, "guided_choice", "1 to"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs", "only one of"),
    ({"structured_outputs": {"regxe": "a"}}, "structured_outputs.regxe", "unknown key"),
    ({"structured_outputs": {"structural_tag": "{}"}}, "structured_outputs.structural_tag", "not supported"),
    ({"structured_outputs": {"json_object": "yes"}}, "structured_outputs.json_object", "true or false"),
    ({"guided_json": SCHEMA, "guided_regex": "a"}, "guided_regex", "only one structured output"),
    ({"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}}, "structured_outputs",
     "response_format is given too"),
])
def test_bad_constraints_are_refused_naming_the_field(fields, param, says):
    err = _refused({**CHAT, **fields})
    assert err.param == param and says in err.message, (err.param, err.message)
    assert len(err.message) < 700  # a parser's message is cut


def test_an_oversized_spec_is_refused_before_it_is_compiled():
    huge = {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(MAX_SPEC_CHARS // 10)}}
    err = _refused({**CHAT, "guided_json": huge})
    assert err.param == "guided_json" and "at most" in err.message


def test_a_gbnf_grammar_reads_as_vllm_and_llama_cpp_write_it():
    """GBNF (`root ::= ...`, xgrammar's and llama.cpp's form) is converted; Lark is taken as it is."""
    import llguidance

    gbnf = StructuredOutputs.text("grammar", 'root ::= "yes" | "no" | num\nnum ::= [0-9]+', "guided_grammar")
    lark = StructuredOutputs.text("grammar", 'start: "yes" | "no" | NUM\nNUM: /[0-9]+/', "guided_grammar")
    for constraint in (gbnf, lark):
        assert llguidance.LLMatcher.validate_grammar(constraint.grammar) == ""


def test_choices_are_literal_text():
    """Quotes, backslashes, `|` and regex metacharacters in a choice are text, not syntax."""
    import llguidance

    choices = ['say "hi"', "back\\slash", "a|b", ".*", "ünï"]
    constraint = StructuredOutputs.choice(choices, "guided_choice")
    assert json.loads(constraint.spec) == choices
    assert llguidance.LLMatcher.validate_grammar(constraint.grammar) == ""
    assert 'start: "say \\"hi\\"" | "back\\\\slash" | "a|b" | ".*" | "ünï"' in constraint.grammar
