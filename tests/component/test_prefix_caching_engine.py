"""Automatic prefix caching in the engine: a request that starts past its cached prefix produces
what it would have computed in full; adapters never share blocks with the base model or with an
earlier load of their name; preemption and handover keep the pool consistent."""

from __future__ import annotations

import pytest
import torch

from elasticmoe.adapters.lora import LoraAdapter
from elasticmoe.config import EngineConfig, ModelConfig
from elasticmoe.engine.llm_engine import LLMEngine
from elasticmoe.sampling_params import SamplingParams
from elasticmoe.tools.make_lora_adapter import make_lora_adapter
from tests.component.test_handover import SharedPool

SYSTEM = [7, 3, 11, 19, 23, 5, 8, 13] * 3  # a shared "system prompt" of 24 tokens: 6 blocks of 4
GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)


def make_engine(model_dir: str, caching: bool = True, kv=None, **overrides) -> LLMEngine:
    fields = dict(model=model_dir, dtype=torch.float32, block_size=4, num_kv_blocks=96, num_threads=1,
                  enable_prefix_caching=caching)
    return LLMEngine(EngineConfig(**{**fields, **overrides}), kv_provider=kv)


def run(engine: LLMEngine, requests: dict[str, list[int]], params: SamplingParams = GREEDY,
        adapter: str | None = None) -> dict[str, list[int]]:
    """Add `requests` at once and step until they finish: output ids by request id."""
    for rid, prompt in requests.items():
        engine.add_request(rid, prompt, params, adapter)
    outputs = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            assert out.finish_reason != "error", out.error
            if out.finished:
                outputs[out.request_id] = out.output_token_ids
    return outputs


def waves(first_answer: list[int]) -> list[dict[str, list[int]]]:
    """One request alone, three sharing its system prompt at once, the first again, and a second
    turn of the first conversation (its prompt and answer, then more)."""
    return [
        {"a": SYSTEM + [40, 41, 42]},
        {"b": SYSTEM + [50, 51], "c": SYSTEM + [60] * 9, "d": SYSTEM[:10] + [70, 71]},
        {"a-again": SYSTEM + [40, 41, 42]},
        {"a-turn-2": SYSTEM + [40, 41, 42] + first_answer + [90, 91, 92, 93]},
    ]


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral", "deepseek_v2"])
def test_outputs_with_prefix_caching_equal_outputs_without(arch, tiny_model_dirs):
    model_dir = tiny_model_dirs[arch]
    plain, cached = make_engine(model_dir, caching=False), make_engine(model_dir)
    first = run(plain, {"a": SYSTEM + [40, 41, 42]})["a"]
    for wave in waves(first):
        admitted_hits = cached.block_manager.prefix_hits
        assert run(cached, wave) == run(plain, wave), f"{arch}: {sorted(wave)}"
        if "a" not in wave:
            assert cached.block_manager.prefix_hits > admitted_hits  # every later wave starts past a prefix
    bm = cached.block_manager
    # b, c: 24 each; d: 8 (its first 10 tokens); a-again: 24 of 27; a-turn-2: its first turn's 36 tokens
    assert bm.prefix_hits == 24 + 24 + 8 + 24 + 36
    assert plain.block_manager.prefix_hits == 0 and plain.block_manager.num_cached_blocks == 0
    assert bm.num_free_blocks == bm.num_blocks
    bm.check_integrity([])


def test_a_pool_that_preempts_keeps_outputs_and_blocks_consistent(tiny_model_dir):
    """A pool too small for the batch: requests are preempted and readmitted past what the cache
    still holds of them, and cached blocks are evicted for new KV."""
    prompts = {str(i): SYSTEM[: 8 + 4 * i] + [100 + i] * (3 + i) for i in range(6)}
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    expected = run(make_engine(tiny_model_dir, caching=False), prompts, params)
    engine = make_engine(tiny_model_dir, num_kv_blocks=24)
    assert run(engine, prompts, params) == expected
    assert engine.scheduler.num_preemptions > 0 and engine.block_manager.prefix_hits > 0
    engine.block_manager.check_integrity([])


def test_a_failed_request_leaves_no_block_behind_and_the_next_one_hits(tiny_model_dir):
    engine = make_engine(tiny_model_dir)
    run(engine, {"warm": SYSTEM + [1, 2]})
    original = engine.grammars.advance
    engine.grammars.advance = lambda request, token: (_ for _ in ()).throw(RuntimeError("boom"))
    engine.add_request("doomed", SYSTEM + [3, 4], GREEDY)
    outs = engine.step()
    assert [o.finish_reason for o in outs] == ["error"] and not engine.has_unfinished_requests()
    engine.grammars.advance = original
    hits = engine.block_manager.prefix_hits
    expected = run(make_engine(tiny_model_dir, caching=False), {"next": SYSTEM + [3, 4]})
    assert run(engine, {"next": SYSTEM + [3, 4]}) == expected
    assert engine.block_manager.prefix_hits > hits
    engine.block_manager.check_integrity([])


def _lora(model_dir: str, path, seed: int) -> LoraAdapter:
    files = make_lora_adapter(model_dir, str(path), rank=2, seed=seed, target_modules=("q_proj", "v_proj"))
    return LoraAdapter.open("tone", files, ModelConfig.from_pretrained(model_dir))


def test_an_adapter_shares_no_block_with_the_base_model_or_with_its_earlier_load(tiny_model_dir, tmp_path):
    first, second = _lora(tiny_model_dir, tmp_path / "v1", seed=1), _lora(tiny_model_dir, tmp_path / "v2", seed=2)

    def lora_engine(adapter: LoraAdapter, caching: bool = True) -> LLMEngine:
        engine = make_engine(tiny_model_dir, caching=caching, max_loras=1, max_lora_rank=2)
        engine.adapters.load_lora("tone", adapter.modules, adapter.weights, adapter.config.scaling)
        return engine

    prompt = {"r": SYSTEM + [40, 41]}
    expected_v1 = run(lora_engine(first, caching=False), prompt, adapter="tone")
    expected_v2 = run(lora_engine(second, caching=False), prompt, adapter="tone")
    assert expected_v1 != expected_v2  # the two loads compute different KV

    engine = lora_engine(first)
    run(engine, prompt)  # the base model caches the prompt's blocks
    assert run(engine, prompt, adapter="tone") == expected_v1
    assert engine.block_manager.prefix_hits == 0  # the adapter's KV is not the base model's
    assert run(engine, prompt, adapter="tone") == expected_v1
    hits = engine.block_manager.prefix_hits
    assert hits == 24  # ... but its own prefix is shared

    assert engine.adapters.unload("tone")
    engine.adapters.load_lora("tone", second.modules, second.weights, second.config.scaling)
    assert run(engine, prompt, adapter="tone") == expected_v2  # the new load does not take the old KV
    assert engine.block_manager.prefix_hits == hits
    engine.block_manager.check_integrity([])


def test_a_handover_keeps_shared_blocks_once_per_request(tiny_model_dir):
    """Requests of one prefix hold the same blocks; handed over with their KV kept, the new engine
    claims each block once per request, and the streams continue exactly."""
    requests = {"b": SYSTEM + [50, 51], "c": SYSTEM + [60, 61, 62]}
    expected = run(make_engine(tiny_model_dir, caching=False), requests)

    shared = SharedPool()
    old = make_engine(tiny_model_dir, kv=shared)
    run(old, {"warm": SYSTEM + [1]})
    for rid, prompt in requests.items():
        old.add_request(rid, prompt, GREEDY)
    outputs: dict[str, list[int]] = {rid: [] for rid in requests}
    for _ in range(3):
        for out in old.step():
            outputs[out.request_id] += out.new_token_ids
    tables = [r.block_ids for r in old.requests.values()]
    assert tables[0][:6] == tables[1][:6]  # the system prompt's blocks, shared
    snaps = old.export_requests(hand_over_kv=True)
    assert old.block_manager.num_cached_blocks == 0  # the pool may be written by its next owner

    new = make_engine(tiny_model_dir, kv=shared)
    new.import_requests(snaps, kv_is_shared=True)
    assert {r.num_cached_tokens for r in new.requests.values()} == {24}  # what their admission found, kept
    shared_block = tables[0][0]
    assert new.block_manager.ref_counts[shared_block] == 2
    new.block_manager.check_integrity(list(new.requests.values()))
    while new.has_unfinished_requests():
        for out in new.step():
            outputs[out.request_id] += out.new_token_ids
    assert outputs == expected
    assert new.block_manager.num_free_blocks == new.block_manager.num_blocks
    new.block_manager.check_integrity([])
    # the blocks it imported are named here: a new request of the prefix takes them
    hits = new.block_manager.prefix_hits
    run(new, {"e": SYSTEM + [80]})
    assert new.block_manager.prefix_hits - hits == 24


def test_requests_of_one_prompt_arriving_together_compute_it_once(tiny_model_dir):
    """`n` choices and a burst of one system prompt: one request computes the prompt, the others
    start a step later past its blocks."""
    prompts = {"n0": SYSTEM + [40, 41, 42], "n1": SYSTEM + [40, 41, 42], "burst": SYSTEM + [50]}
    expected = run(make_engine(tiny_model_dir, caching=False), prompts)
    engine = make_engine(tiny_model_dir)
    assert run(engine, prompts) == expected
    assert engine.block_manager.prefix_hits == 24 + 24  # n1: 24 of its 27 tokens (its last block holds its last
    # token), burst: 24 of 25
    engine.block_manager.check_integrity([])


def test_a_cache_salt_shares_blocks_only_with_requests_of_the_same_salt(tiny_model_dir):
    engine = make_engine(tiny_model_dir)
    prompt = SYSTEM + [40, 41]

    def hits_of(salt: str | None) -> int:
        before = engine.block_manager.prefix_hits
        run(engine, {f"r-{salt}-{before}": prompt}, SamplingParams(temperature=0.0, max_tokens=2, cache_salt=salt))
        return engine.block_manager.prefix_hits - before

    assert hits_of("tenant-a") == 0
    assert hits_of("tenant-b") == 0  # another tenant's identical prompt does not find tenant a's blocks
    assert hits_of(None) == 0  # nor does an unsalted one
    assert (hits_of("tenant-a"), hits_of("tenant-b"), hits_of(None)) == (24, 24, 24)  # each finds its own
    engine.block_manager.check_integrity([])
