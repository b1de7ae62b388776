"""A request resumed on another engine from what its client received continues exactly.

The oracle is the undisturbed run of the same request: the resumed engine recomputes the
KV of the prompt + received tokens and must then stream the same tokens and the same text,
nothing twice and nothing skipped, greedy or seeded (the seeded generator is replayed), with
penalties too (they count the received tokens) and under a grammar (its matcher replays them).
"""

from __future__ import annotations

import pytest
import torch

from elasticmoe.config import EngineConfig
from elasticmoe.engine.engine_request import EngineRequest
from elasticmoe.engine.llm_engine import LLMEngine
from elasticmoe.errors import InvalidRequestError
from elasticmoe.sampling_params import SamplingParams
from elasticmoe.structured_outputs import StructuredOutputs

PROMPT = [11, 22, 33, 44, 55]
PARAMS = {
    "greedy": SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True),
    "seeded": SamplingParams(temperature=0.9, top_p=0.95, seed=7, max_tokens=24, ignore_eos=True),
    "stop-string": SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, stop=["zzqq"]),
    # the penalties count the output the client already has: a resumed request must count it too
    "penalties": SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, presence_penalty=0.7,
                                frequency_penalty=0.4, logit_bias={7: 2.0}, repetition_penalty=1.2),
    # a stop token the bias makes likely, held back for 12 tokens: the resumed request counts what it had
    "min-tokens": SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, stop_token_ids=[7],
                                 logit_bias={7: 100.0}, min_tokens=12),
    "seeded-penalties": SamplingParams(temperature=0.9, seed=5, max_tokens=24, ignore_eos=True, frequency_penalty=1.5),
    # the resumed engine's matcher consumes the output the client has: the grammar goes on from there
    "structured": SamplingParams(temperature=0.9, seed=3, max_tokens=24, structured_outputs=StructuredOutputs.text(
        "regex", "[a-z]{4,8}( [a-z]{4,8}){2,9}", "guided_regex")),
}


@pytest.fixture(scope="module")
def engines(tiny_model_dir):
    return [LLMEngine(EngineConfig(model=tiny_model_dir, dtype=torch.float32)) for _ in range(2)]


def _stream(engine: LLMEngine, request: EngineRequest, stop_after: int | None = None):
    """(token ids, text deltas) streamed for `request`; aborted after `stop_after` outputs."""
    engine.add(request)
    ids, texts = [], []
    while engine.has_unfinished_requests():
        for out in engine.step():
            ids += out.new_token_ids
            texts.append(out.new_text)
            if out.finished or (stop_after is not None and len(ids) >= stop_after):
                engine.abort(request.request_id)
                return ids, texts, out.finish_reason
    raise AssertionError("the request never finished")


@pytest.mark.parametrize("kind", list(PARAMS))
@pytest.mark.parametrize("cut", [1, 9])
def test_resumed_request_streams_what_the_undisturbed_run_did(engines, kind, cut):
    first, second = engines
    params = PARAMS[kind]
    ids, texts, reason = _stream(first, EngineRequest("whole", PROMPT, params))
    head_ids, head_texts, _ = _stream(first, EngineRequest("head", PROMPT, params), stop_after=cut)
    assert head_ids == ids[:cut]  # same prefix: deterministic engine
    resumed = EngineRequest("tail", PROMPT, params).resumed(head_ids, sum(map(len, head_texts)))
    tail_ids, tail_texts, tail_reason = _stream(second, resumed)
    assert head_ids + tail_ids == ids
    assert "".join(head_texts + tail_texts) == "".join(texts)
    assert tail_reason == reason
    assert not second.requests and second.block_manager.num_free_blocks == second.block_manager.num_blocks


def test_a_resume_past_max_tokens_or_the_vocabulary_is_refused(engines):
    engine = engines[0]
    params = SamplingParams(temperature=0.0, max_tokens=4)
    with pytest.raises(InvalidRequestError) as info:
        engine.add(EngineRequest("r", PROMPT, params).resumed([1, 2, 3, 4], 4))
    assert info.value.param == "resume"
    with pytest.raises(InvalidRequestError):
        engine.add(EngineRequest("r", PROMPT, params).resumed([10**6], 1))
    assert not engine.requests
