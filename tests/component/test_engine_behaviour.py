"""Engine behaviour on the tiny model: batching, preemption, providers, bad input."""

from __future__ import annotations

import random

import pytest
import torch

from elasticmoe.config import EngineConfig
from elasticmoe.engine.kv_cache import KVCacheSpec
from elasticmoe.engine.llm_engine import LLMEngine
from elasticmoe.errors import InvalidRequestError
from elasticmoe.models.weights import ParamSpec, SafetensorsWeightProvider
from elasticmoe.sampling_params import SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


def make_prompts(n: int, seed: int = 0, vocab: int = 500) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(rng.randint(1, 60))] for _ in range(n)]


def run_all(engine: LLMEngine, prompts, params=GREEDY) -> dict[str, list[int]]:
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, params)
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.output_token_ids
    return done


def engine_for(model_dir, **kw) -> LLMEngine:
    return LLMEngine(EngineConfig(model=model_dir, dtype=torch.float32, **kw))


@pytest.mark.parametrize("arch", ["qwen3_moe", "deepseek_v2"])
def test_batch_invariance_32_mixed_lengths(arch, tiny_model_dirs):
    prompts = make_prompts(32)
    engine = engine_for(tiny_model_dirs[arch], max_num_batched_tokens=256)
    batched = run_all(engine, prompts)
    for i, p in enumerate(prompts):
        alone = run_all(engine, [p])
        assert alone["r0"] == batched[f"r{i}"], f"prompt {i} (len {len(p)})"


def test_small_kv_pool_preempts_and_still_matches(tiny_model_dir):
    prompts = make_prompts(12, seed=1)
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    reference = run_all(engine_for(tiny_model_dir), prompts, params)
    small = engine_for(tiny_model_dir, block_size=4, num_kv_blocks=40)  # 160 tokens for ~12 x 54
    got = run_all(small, prompts, params)
    assert small.scheduler.num_preemptions > 0
    assert got == reference
    assert small.block_manager.num_free_blocks == small.block_manager.num_blocks
    small.block_manager.check_integrity([])


class RecordingWeightProvider:
    def __init__(self, model_dir):
        self.disk = SafetensorsWeightProvider(model_dir)
        self.given: dict[str, torch.Tensor] = {}

    def get(self, spec: ParamSpec, dtype: torch.dtype) -> torch.Tensor:
        self.given[spec.name] = self.disk.get(spec, dtype)
        return self.given[spec.name]


class RecordingKVProvider:
    pool: torch.Tensor | None = None

    def allocate(self, spec: KVCacheSpec, num_blocks: int) -> torch.Tensor:
        self.pool = torch.zeros(spec.pool_shape(num_blocks), dtype=spec.dtype)
        return self.pool


def test_injected_providers_are_used_in_place(tiny_model_dir):
    weights, kv = RecordingWeightProvider(tiny_model_dir), RecordingKVProvider()
    engine = LLMEngine(EngineConfig(model=tiny_model_dir, dtype=torch.float32, num_kv_blocks=32), weights, kv)
    model = engine.model
    assert engine.kv_pool.data_ptr() == kv.pool.data_ptr()
    assert model.embed.data_ptr() == weights.given["embed"].data_ptr()
    assert model.lm_head.data_ptr() == weights.given["lm_head"].data_ptr()
    for i, layer in enumerate(model.layers):
        assert layer.attn.qkv.data_ptr() == weights.given[f"layers.{i}.attn.qkv"].data_ptr()
        assert layer.mlp.w13.data_ptr() == weights.given[f"layers.{i}.moe.w13"].data_ptr()
        assert layer.mlp.w2.data_ptr() == weights.given[f"layers.{i}.moe.w2"].data_ptr()

    before = run_all(engine, [[5, 6, 7]])["r0"]
    # A write through the provider's tensor must change what the engine computes.
    weights.given["lm_head"].zero_()  # all logits 0: greedy picks token 0 every time
    after = run_all(engine, [[5, 6, 7]])["r0"]
    assert before != [0] * 12 and after == [0] * 12
    assert kv.pool.abs().sum() > 0  # the engine wrote its KV into the provider's pool


def test_bad_input_names_the_field_and_engine_keeps_serving(tiny_model_dir):
    engine = engine_for(tiny_model_dir, max_model_len=64)
    engine.add_request("good", [1, 2, 3], GREEDY)
    cases = [
        ("long", list(range(3, 80)), GREEDY, "prompt"),
        ("empty", [], GREEDY, "prompt"),
        ("vocab", [10**6], GREEDY, "prompt"),
        ("type", [1.5], GREEDY, "prompt"),
        ("budget", [1, 2], SamplingParams(max_tokens=100), "max_tokens"),
        ("stopid", [1, 2], SamplingParams(stop_token_ids=[10**6]), "stop_token_ids"),
        ("good", [1, 2], GREEDY, "request_id"),
    ]
    for request_id, prompt, params, param in cases:
        with pytest.raises(InvalidRequestError) as info:
            engine.add_request(request_id, prompt, params)
        assert info.value.param == param, request_id
    done = {}
    while engine.has_unfinished_requests():
        done.update({o.request_id: o for o in engine.step() if o.finished})
    assert list(done) == ["good"] and len(done["good"].output_token_ids) == 12


def test_abort_frees_blocks(tiny_model_dir):
    engine = engine_for(tiny_model_dir, num_kv_blocks=64)
    engine.add_request("a", list(range(3, 50)), SamplingParams(max_tokens=50))
    # (not a prefix of a's prompt: b would wait a step to take a's blocks from the prefix cache)
    engine.add_request("b", list(range(60, 77)), SamplingParams(max_tokens=50))
    engine.step()
    engine.abort("a")
    engine.abort("missing")  # no-op
    assert engine.num_running == 1
    engine.abort("b")
    assert not engine.has_unfinished_requests()
    assert engine.block_manager.num_free_blocks == 64


def test_stop_strings_seed_and_logprobs(tiny_model_dir):
    engine = engine_for(tiny_model_dir)
    greedy = run_all(engine, [[5, 6, 7]], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))["r0"]
    text = engine.tokenizer.decode(greedy)
    stop = text[len(text) // 2 : len(text) // 2 + 2]
    assert stop.strip(), "the tiny model's greedy text should contain visible characters"
    engine.add_request("s", [5, 6, 7], SamplingParams(temperature=0, max_tokens=16, stop=[stop], ignore_eos=True))
    outs = []
    while engine.has_unfinished_requests():
        outs += engine.step()
    final = outs[-1]
    assert final.finish_reason == "stop" and final.stop_reason == stop
    assert final.text == text[: text.index(stop)]
    assert "".join(o.new_text for o in outs) == final.text

    seeded = SamplingParams(temperature=1.0, top_p=0.9, top_k=50, seed=7, max_tokens=16, ignore_eos=True)
    a = run_all(engine, [[5, 6, 7]], seeded)["r0"]
    b = run_all(engine, [[5, 6, 7], [9, 9]], seeded)["r0"]
    assert a == b

    engine.add_request("lp", [5, 6, 7], SamplingParams(temperature=0, max_tokens=3, logprobs=5, ignore_eos=True))
    outs = []
    while engine.has_unfinished_requests():
        outs += engine.step()
    logprobs = [lp for o in outs for lp in (o.new_logprobs or [])]
    assert len(logprobs) == 3
    for lp in logprobs:
        assert len(lp.top_logprobs) == 5
        assert lp.top_logprobs[0][0] == lp.token_id  # greedy picks the most likely token
        assert lp.logprob == pytest.approx(lp.top_logprobs[0][2]) and lp.logprob <= 0


def test_stop_token_ids_and_eos(tiny_model_dir):
    engine = engine_for(tiny_model_dir)
    greedy = run_all(engine, [[5, 6, 7]], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))["r0"]
    engine.add_request("t", [5, 6, 7], SamplingParams(temperature=0, max_tokens=8, stop_token_ids=[greedy[3]]))
    outs = []
    while engine.has_unfinished_requests():
        outs += engine.step()
    stop_at = greedy.index(greedy[3])
    assert outs[-1].output_token_ids == greedy[: stop_at + 1]
    assert outs[-1].finish_reason == "stop" and outs[-1].stop_reason == greedy[3]


def test_threads_are_bound_on_the_thread_that_steps(tiny_model_dir, monkeypatch):
    """OpenMP keeps a team per thread: the pinning must be done by each thread that steps (a
    server's engine thread), not only by the one that built the engine."""
    import threading

    from elasticmoe.engine import model_runner

    bound_on = []
    monkeypatch.setattr(model_runner, "bind_threads", lambda n: bound_on.append(threading.get_ident()))
    engine = engine_for(tiny_model_dir, num_threads=2)
    want = run_all(engine, make_prompts(2))
    other: dict = {}
    stepper = threading.Thread(target=lambda: other.update(run_all(engine, make_prompts(2))))
    stepper.start()
    stepper.join()
    assert other == want  # the same engine, stepped from another thread
    assert bound_on == [threading.get_ident(), stepper.ident]  # each thread once, at its first step
