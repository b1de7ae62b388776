"""A request that raises inside the engine fails alone: its batch-mates finish unchanged.

Faults are injected where a request's own data is used (the forward, sampling, the
detokenizer) and only when the poisoned request is in the batch; the oracle is the same
requests run without it.
"""

from __future__ import annotations

import pytest
import torch

from elasticmoe.config import EngineConfig
from elasticmoe.engine.llm_engine import LLMEngine
from elasticmoe.sampling_params import SamplingParams

GOOD = {"a": ([5, 6, 7, 8], 12), "b": ([9, 10, 11], 9)}


def _engine(model_dir: str) -> LLMEngine:
    return LLMEngine(EngineConfig(model=model_dir, dtype=torch.float32))


def _run(engine: LLMEngine, with_bad: bool) -> dict[str, tuple[list[int], str | None]]:
    for rid, (prompt, n) in GOOD.items():
        engine.add_request(rid, prompt, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
    if with_bad:
        engine.add_request("bad", [3, 4], SamplingParams(temperature=0.8, seed=666, max_tokens=20, ignore_eos=True))
    done: dict[str, tuple[list[int], str | None]] = {}
    for _ in range(100):
        for out in engine.step():
            if out.finished:
                done[out.request_id] = (out.output_token_ids, out.finish_reason)
        if not engine.has_unfinished_requests():
            break
    assert not engine.requests and engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    return done


@pytest.fixture(scope="module")
def reference(tiny_model_dir):
    return _run(_engine(tiny_model_dir), with_bad=False)


def _poison_sampler(engine: LLMEngine) -> None:
    sampler = engine.sampler

    def sample(logits, requests):
        if any(r.request_id == "bad" for r in requests):
            raise RuntimeError("injected: sampling this request fails")
        return sampler(logits, requests)

    engine.sampler = sample  # type: ignore[assignment]


def _poison_forward(engine: LLMEngine) -> None:
    execute = engine.runner.execute

    def run(sched):
        if any(r.request_id == "bad" for r, _ in sched.scheduled):
            raise RuntimeError("injected: the forward of this request fails")
        return execute(sched)

    engine.runner.execute = run  # type: ignore[method-assign]


def _poison_detokenizer(engine: LLMEngine) -> None:
    append = engine.output_processor.append_token

    def append_token(request, token_id, logprob, *rest):
        if request.request_id == "bad" and request.num_output_tokens >= 3:
            raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "injected")
        return append(request, token_id, logprob, *rest)

    engine.output_processor.append_token = append_token  # type: ignore[method-assign]


@pytest.mark.parametrize("poison", [_poison_sampler, _poison_forward, _poison_detokenizer],
                         ids=["sampling", "forward", "detokenizer"])
def test_only_the_poisoned_request_fails(tiny_model_dir, reference, poison):
    engine = _engine(tiny_model_dir)
    poison(engine)
    done = _run(engine, with_bad=True)
    assert done["bad"][1] == "error"
    assert {rid: done[rid] for rid in GOOD} == reference  # same tokens as without the bad request
    # The engine keeps serving afterwards.
    assert _run(engine, with_bad=False) == reference
