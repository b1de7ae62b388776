"""ESFT adapters beyond the slots of one engine (`engine.esft_disk_tier`): three adapters through one
slot, requests for all of them mixed in one queue; every request's greedy tokens and logprobs
equal its merged model's alone, the slot swaps without a request failing, and the eviction never
takes the rows a running request reads. Also: an adapter whose files vanished fails only its own
requests (the engine and the others go on), unloading an adapter on disk, and the limits that
still apply on disk (experts per layer, a name twice)."""

from __future__ import annotations

import shutil

import pytest
import torch

from elasticmoe.adapters.esft import EsftAdapter
from elasticmoe.config import EngineConfig, ModelConfig
from elasticmoe.engine.llm_engine import LLMEngine
from elasticmoe.errors import AdapterConflictError, AdapterLimitError, UnknownAdapterError
from elasticmoe.sampling_params import SamplingParams
from elasticmoe.tools.make_esft_adapter import make_esft_adapter, write_merged_model

PROMPTS = [[5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17], [30, 31, 32], [40, 41, 42, 43, 44]]
PARAMS = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, logprobs=3)
NAMES = ("alpha", "beta", "gamma")


@pytest.fixture(scope="module")
def setup(tiny_model_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("esft-disk")
    config = ModelConfig.from_pretrained(tiny_model_dir)
    paths, merged = {}, {}
    for seed, name in enumerate(NAMES, start=1):
        paths[name] = make_esft_adapter(tiny_model_dir, str(root / name), experts_per_layer=2, seed=seed, noise=0.5)
        merged[name] = str(write_merged_model(tiny_model_dir, paths[name], str(root / f"{name}-merged")))
    return tiny_model_dir, config, paths, merged, root


def _engine(model_dir: str, **kwargs) -> LLMEngine:
    return LLMEngine(EngineConfig(model=model_dir, dtype=torch.float32, num_kv_blocks=256, num_threads=1,
                                  max_num_batched_tokens=16, **kwargs))


def _register(engine: LLMEngine, name: str, path: str, config: ModelConfig) -> int | None:
    adapter = EsftAdapter.open(name, path, config)
    return engine.adapters.load_esft(name, adapter.config.experts, adapter.expert_weights, files=adapter)


def _run(engine: LLMEngine, requests: list[tuple[str, list[int], str | None]], check=None) -> dict[str, tuple]:
    """request id -> (finish reason, output ids, [(token, logprob, top ids)]); `check(engine)` after every step."""
    for rid, prompt, adapter in requests:
        engine.add_request(rid, prompt, PARAMS, adapter)
    steps: dict[str, list] = {rid: [] for rid, _, _ in requests}
    final = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            steps[o.request_id] += o.new_logprobs or []
            if o.finished:
                final[o.request_id] = (o.finish_reason, o.output_token_ids)
        if check is not None:
            check(engine)
    return {rid: (*final[rid], [(lp.token_id, lp.logprob, [t for t, _, _ in lp.top_logprobs]) for lp in steps[rid]])
            for rid in steps}


def _same(got: tuple, want: tuple) -> None:
    assert got[:2] == want[:2]
    for (tok, lp, top), (wtok, wlp, wtop) in zip(got[2], want[2], strict=True):
        assert tok == wtok and top == wtop and lp == pytest.approx(wlp, abs=1e-4)


def _no_running_request_lost_its_rows(engine: LLMEngine) -> None:
    slots = engine.adapters.esft
    for r in engine.scheduler.running:
        b = r.binding
        if b.is_esft:
            assert not b.is_waiting and slots.index(b.name) == b.esft_slot, (r.request_id, b)


def test_three_adapters_through_one_slot_equal_their_merged_models(setup):
    base, config, paths, merged, _ = setup
    engine = _engine(base, max_esft_adapters=1, max_esft_experts=2)
    assert [_register(engine, n, paths[n], config) for n in NAMES] == [0, None, None]
    assert engine.adapters.served == NAMES  # all accept requests; two are on disk
    listed = {a["name"]: a for a in engine.adapters.describe()}
    assert [(listed[n]["slot"], listed[n]["resident"]) for n in NAMES] == [(0, True), (None, False), (None, False)]

    # interleaved: every adapter's requests sit in the queue at once, behind and between the others'
    requests = [(f"{a or 'base'}-{i}", p, a) for i, p in enumerate(PROMPTS) for a in (None, "gamma", "alpha", "beta")]
    got = _run(engine, requests, check=_no_running_request_lost_its_rows)

    for name in (None, *NAMES):
        want = _run(_engine(merged[name] if name else base), [(f"{name or 'base'}-{i}", p, None)
                                                                for i, p in enumerate(PROMPTS)])
        for rid, result in want.items():
            assert got[rid][0] == "length", got[rid]
            _same(got[rid], result)
    stats = engine.adapters.stats()
    assert stats["esft_registered"] == 3 and stats["esft_resident"] == 1
    assert stats["esft_swaps_in"] >= 2 and stats["esft_evictions"] >= 2


def test_an_adapter_whose_files_vanished_fails_only_its_requests(setup):
    base, config, paths, _, root = setup
    engine = _engine(base, max_esft_adapters=1, max_esft_experts=2)
    _register(engine, "alpha", paths["alpha"], config)
    doomed = shutil.copytree(paths["beta"], root / "doomed")
    _register(engine, "doomed", str(doomed), config)
    shutil.rmtree(doomed)
    got = _run(engine, [("d", PROMPTS[1], "doomed"), ("a", PROMPTS[1], "alpha"), ("b", PROMPTS[1], None)])
    assert got["d"][0] == "error" and got["d"][1] == []
    assert got["a"][0] == got["b"][0] == "length"
    assert "doomed" in engine.adapters.served  # still registered: DELETE it, or restore its files
    assert engine.adapters.unload("doomed") is True
    assert "doomed" not in engine.adapters.served
    with pytest.raises(UnknownAdapterError):
        engine.add_request("x", PROMPTS[1], PARAMS, "doomed")


def test_limits_that_apply_on_disk_too(setup):
    base, config, paths, _, _ = setup
    engine = _engine(base, max_esft_adapters=1, max_esft_experts=1)  # the adapters tune 2 experts per layer
    with pytest.raises(AdapterLimitError, match="per layer"):
        _register(engine, "alpha", paths["alpha"], config)
    engine = _engine(base, max_esft_adapters=1, max_esft_experts=2)
    _register(engine, "alpha", paths["alpha"], config)
    _register(engine, "beta", paths["beta"], config)
    with pytest.raises(AdapterConflictError, match="already loaded"):
        _register(engine, "beta", paths["gamma"], config)
    adapter = EsftAdapter.open("gamma", paths["gamma"], config)
    with pytest.raises(AdapterLimitError, match="slots"):  # a caller that gives no files: no disk tier
        engine.adapters.load_esft("gamma", adapter.config.experts, adapter.expert_weights)


def test_a_swap_whose_requests_were_aborted_before_running_does_not_pin_the_slot(setup):
    """beta is swapped in for a request that cannot start yet (the only sequence is taken) and is
    then aborted: beta must not stay "just swapped in" forever, alpha's request takes the slot."""
    base, config, paths, merged, _ = setup
    engine = _engine(base, max_esft_adapters=1, max_esft_experts=2, max_num_seqs=1)
    for name in ("alpha", "beta"):
        _register(engine, name, paths[name], config)
    long = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    engine.add_request("base", PROMPTS[1], long)  # holds the only sequence for 6 steps
    engine.step()
    engine.add_request("b", PROMPTS[1], PARAMS, "beta")
    engine.step()  # beta swapped in for "b", which cannot start
    assert engine.adapters.esft.index("beta") == 0
    engine.abort("b")
    engine.add_request("a", PROMPTS[1], PARAMS, "alpha")
    finished = {}
    for _ in range(200):
        for o in engine.step():
            if o.finished:
                finished[o.request_id] = (o.finish_reason, o.output_token_ids)
        if not engine.has_unfinished_requests():
            break
    assert set(finished) == {"base", "a"} and finished["a"][0] == "length", finished
    want = _run(_engine(merged["alpha"]), [("a", PROMPTS[1], None)])
    assert finished["a"][1] == want["a"][1]
