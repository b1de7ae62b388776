"""Structured outputs in the engine.

Oracle: greedy generation under a grammar equals transformers' `generate` with a logits processor
that masks with an independent llguidance matcher of the same grammar (so the engine applies the
mask and changes nothing else), for the three families; a plain request in the same batch is
unchanged. Sampled answers match their constraint (a JSON schema, a regex, a choice, a Lark
grammar), end with "stop" once complete, and a broken matcher fails its request alone.
"""

from __future__ import annotations

import json
import re

import jsonschema
import llguidance
import numpy as np
import pytest
import torch

from elasticmoe.config import EngineConfig
from elasticmoe.engine.engine_request import EngineRequest
from elasticmoe.engine.llm_engine import LLMEngine
from elasticmoe.engine.structured_output import StructuredOutputError
from elasticmoe.errors import InvalidRequestError
from elasticmoe.sampling_params import SamplingParams
from elasticmoe.structured_outputs import StructuredOutputs

ARCHS = ("qwen3_moe", "mixtral", "deepseek_v2")
PROMPT = [5, 17, 99, 230, 11]
MAX_TOKENS = 48
SCHEMA = {"type": "object", "additionalProperties": False, "required": ["answer", "count", "note"],
          "properties": {"answer": {"enum": ["yes", "no"]}, "count": {"type": "integer", "minimum": 0, "maximum": 999},
                         "note": {"type": "string", "maxLength": 8}}}
REGEX = r"[0-9]{3}-[a-z]{2,5}"
GRAMMAR = 'start: "(" NUM ("+" NUM)? ("+" NUM)? ")"\nNUM: /[0-9]{1,3}/'  # bounded: every answer ends
CONSTRAINTS = {
    "json": StructuredOutputs.json_schema(SCHEMA, "guided_json"),
    "regex": StructuredOutputs.text("regex", REGEX, "guided_regex"),
    "choice": StructuredOutputs.choice(["red", 'say "hi"', "blue\\green"], "guided_choice"),
    "grammar": StructuredOutputs.text("grammar", GRAMMAR, "guided_grammar"),
}


def _matches(kind: str, text: str) -> bool:
    if kind == "json":
        jsonschema.validate(json.loads(text), SCHEMA)
        return True
    if kind == "regex":
        return re.fullmatch(REGEX, text) is not None
    if kind == "choice":
        return text in ("red", 'say "hi"', "blue\\green")
    return re.fullmatch(r"\([0-9]{1,3}(\+[0-9]{1,3}){0,2}\)", text) is not None


def _run(engine: LLMEngine, requests: dict[str, SamplingParams], prompt=PROMPT) -> dict:
    for request_id, params in requests.items():
        engine.add_request(request_id, prompt, params)
    finished = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
    return finished


class _GrammarMask:
    """transformers logits processor: -inf where an llguidance matcher of the grammar forbids."""

    def __init__(self, lltokenizer: llguidance.LLTokenizer, constraint: StructuredOutputs, prompt_len: int) -> None:
        self.matcher = llguidance.LLMatcher(lltokenizer, constraint.grammar)
        self.words = (lltokenizer.vocab_size + 31) // 32
        self.prompt_len = prompt_len
        self.fed = 0

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        output = input_ids[0, self.prompt_len :].tolist()
        assert self.matcher.consume_tokens(output[self.fed :])
        self.fed = len(output)
        mask = np.zeros((self.words,), dtype=np.int32)
        self.matcher.unsafe_compute_mask_ptr(mask.ctypes.data, mask.nbytes)
        allowed = np.unpackbits(mask.view(np.uint8), bitorder="little")[: scores.shape[-1]].astype(bool)
        return scores.masked_fill(~torch.from_numpy(allowed), float("-inf"))


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    return LLMEngine(EngineConfig(model=tiny_model_dir, dtype=torch.float32))


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_under_a_grammar_equals_transformers_with_the_same_mask(arch, tiny_model_dirs):
    from transformers import AutoModelForCausalLM, LogitsProcessorList

    model_dir = tiny_model_dirs[arch]
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    engine = LLMEngine(EngineConfig(model=model_dir, dtype=torch.float32))
    requests = {kind: SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, structured_outputs=c)
                for kind, c in CONSTRAINTS.items()}
    requests["plain"] = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    ours = _run(engine, requests)  # one batch: each row masks alone
    lltokenizer = llguidance.LLTokenizer(engine.tokenizer.backend_json(), n_vocab=engine.model_config.vocab_size,
                                         eos_token=list(engine.sampler.eos_token_ids))
    for kind, params in requests.items():
        processors = None
        if params.structured_outputs is not None:
            processors = LogitsProcessorList([_GrammarMask(lltokenizer, params.structured_outputs, len(PROMPT))])
        with torch.no_grad():
            ref = hf.generate(torch.tensor([PROMPT]), max_new_tokens=len(ours[kind].output_token_ids),
                              min_new_tokens=len(ours[kind].output_token_ids), do_sample=False,
                              logits_processor=processors)
        assert ours[kind].output_token_ids == ref[0, len(PROMPT) :].tolist(), f"{arch}: {kind}"
        if kind != "plain":
            assert ours[kind].finish_reason == "stop" and _matches(kind, ours[kind].text), (kind, ours[kind].text)


@pytest.mark.parametrize("kind", list(CONSTRAINTS))
def test_sampled_answers_match_their_constraint_and_stop_when_complete(engine, kind):
    requests = {f"{kind}-{seed}": SamplingParams(temperature=1.0, seed=seed, max_tokens=64,
                                                 structured_outputs=CONSTRAINTS[kind]) for seed in range(6)}
    finished = _run(engine, requests)
    for request_id, out in finished.items():
        assert out.finish_reason == "stop", (request_id, out.text)
        assert _matches(kind, out.text), (request_id, out.text)
        assert out.output_token_ids[-1] not in engine.sampler.eos_token_ids  # complete: no EOS needed
    assert not engine.requests and engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_a_json_object_request_cut_by_max_tokens_ends_with_length(engine):
    params = SamplingParams(temperature=0.0, max_tokens=3, structured_outputs=StructuredOutputs("json_object"))
    out = _run(engine, {"cut": params})["cut"]
    assert out.finish_reason == "length" and out.text.startswith("{") and len(out.output_token_ids) == 3


def test_the_grammar_wins_where_min_tokens_forbids_all_it_allows(engine):
    """After "a" the regex allows only "b" or the end (EOS); `min_tokens` holds back both ("b" is a
    stop token): the row chooses from the grammar's tokens unadjusted instead of from nothing."""
    b = engine.tokenizer.encode("b")
    assert len(b) == 1
    params = SamplingParams(temperature=0.0, max_tokens=8, min_tokens=6, stop_token_ids=b,
                            structured_outputs=StructuredOutputs.text("regex", "ab?", "guided_regex"))
    out = _run(engine, {"r": params})["r"]
    assert out.finish_reason == "stop" and out.text in ("a", "ab")


def test_a_resumed_constrained_request_continues_the_grammar(engine, tiny_model_dir):
    params = SamplingParams(temperature=0.8, seed=3, max_tokens=40, structured_outputs=CONSTRAINTS["json"])
    whole = _run(engine, {"whole": params})["whole"]
    head = whole.output_token_ids[:5]
    other = LLMEngine(EngineConfig(model=tiny_model_dir, dtype=torch.float32))
    other.add(EngineRequest("tail", PROMPT, params).resumed(head, len(other.tokenizer.decode(head))))
    tail = []
    while other.has_unfinished_requests():
        for out in other.step():
            tail += out.new_token_ids
    assert head + tail == whole.output_token_ids
    # An output that the grammar forbids cannot be resumed under it.
    with pytest.raises(InvalidRequestError) as info:
        other.add(EngineRequest("bad", PROMPT, params).resumed(engine.tokenizer.encode("xyz"), 3))
    assert info.value.param == "resume" and "bad" not in other.requests


def test_a_broken_matcher_fails_its_request_alone(engine):
    params = SamplingParams(temperature=0.0, max_tokens=12, structured_outputs=CONSTRAINTS["regex"])
    plain = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    engine.add_request("broken", PROMPT, params)
    engine.add_request("plain", PROMPT, plain)
    engine.step()  # prefill: both sampled their first token
    engine.requests["broken"].matcher.consume_token(engine.tokenizer.encode("x")[0])  # "x" is never allowed
    finished = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
    assert finished["broken"].finish_reason == "error"
    assert finished["plain"].finish_reason == "length" and len(finished["plain"].output_token_ids) == 12
    after = _run(engine, {"after": SamplingParams(temperature=0.0, max_tokens=32, structured_outputs=CONSTRAINTS["regex"])})
    assert after["after"].finish_reason == "stop"  # the broken one was a copy: the compiled grammar is intact


def test_advance_refuses_a_token_the_grammar_forbids(engine):
    engine.add_request("r", PROMPT, SamplingParams(max_tokens=4, structured_outputs=CONSTRAINTS["choice"]))
    request = engine.requests["r"]
    with pytest.raises(StructuredOutputError):
        engine.grammars.advance(request, engine.tokenizer.encode("z")[0])
    engine.abort("r")


def test_a_grammar_past_the_parser_limits_fails_its_request_alone(engine):
    """`(x{1000}){1000}` compiles, then its first mask exceeds the lexer's limits: that request ends
    with "error" (its step bounded by `parser_limits`), the other request of the batch is served."""
    bomb = SamplingParams(max_tokens=8, structured_outputs=StructuredOutputs.text("regex", "(x{1000}){1000}",
                                                                                  "guided_regex"))
    engine.add_request("bomb", PROMPT, bomb)
    engine.add_request("plain", PROMPT, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    finished = _run(engine, {})
    assert finished["bomb"].finish_reason == "error" and "structured output" in finished["bomb"].error.lower()
    assert finished["plain"].finish_reason == "length" and len(finished["plain"].output_token_ids) == 8


def test_a_schema_nested_too_deeply_is_refused_by_name():
    deep: dict = {"type": "string"}
    for _ in range(5000):
        deep = {"type": "object", "properties": {"a": deep}}
    with pytest.raises(InvalidRequestError) as info:
        StructuredOutputs.json_schema(deep, "guided_json")
    assert info.value.param == "guided_json"


def test_a_grammar_is_compiled_once_for_the_requests_that_share_it(tiny_model_dir):
    """Each request gets a copy of the compiled matcher: equal answers to those of an engine that
    compiles per request, and one compile per distinct grammar (least recently used out first)."""
    engine = LLMEngine(EngineConfig(model=tiny_model_dir, dtype=torch.float32))
    requests = {f"json-{seed}": SamplingParams(temperature=1.0, seed=seed, max_tokens=64,
                                               structured_outputs=CONSTRAINTS["json"]) for seed in range(4)}
    requests["regex"] = SamplingParams(temperature=1.0, seed=9, max_tokens=32, structured_outputs=CONSTRAINTS["regex"])
    shared = _run(engine, requests)
    assert engine.grammars.num_compiles == 2
    again = _run(engine, {"json-again": requests["json-0"]})["json-again"]
    assert engine.grammars.num_compiles == 2 and again.output_token_ids == shared["json-0"].output_token_ids
    alone = LLMEngine(EngineConfig(model=tiny_model_dir, dtype=torch.float32))
    for request_id, params in requests.items():
        alone.grammars._compiled.clear()  # compiled for this request alone
        assert _run(alone, {request_id: params})[request_id].output_token_ids == shared[request_id].output_token_ids
    engine.grammars.MAX_COMPILED = 1
    _run(engine, {"grammar": SamplingParams(max_tokens=16, structured_outputs=CONSTRAINTS["grammar"])})
    assert list(engine.grammars._compiled) == [CONSTRAINTS["grammar"].grammar]


def test_a_tokenizer_llguidance_cannot_read_refuses_constrained_requests_by_name(tiny_model_dir):
    """Built once: every constrained request gets the 400 naming its field; plain ones are served."""
    engine = LLMEngine(EngineConfig(model=tiny_model_dir, dtype=torch.float32))
    engine.tokenizer.backend_json = lambda: '{"not": "a tokenizer"}'  # type: ignore[method-assign]
    for field in ("guided_regex", "response_format"):
        constraint = StructuredOutputs.text("regex", "[a-z]+", field)
        with pytest.raises(InvalidRequestError) as info:
            engine.add_request(field, PROMPT, SamplingParams(max_tokens=4, structured_outputs=constraint))
        assert info.value.param == field and "not available for this model" in info.value.message
    assert not engine.requests
    assert _run(engine, {"plain": SamplingParams(max_tokens=3, ignore_eos=True)})["plain"].finish_reason == "length"
