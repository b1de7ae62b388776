"""ESFT adapters in one engine (ExpertWeave): 3 adapters loaded together over one base model.

Each request's greedy tokens and logprobs (top-5 at every step) equal those of the merged
model (base with that adapter's experts swapped in) served alone, in mixed batches of
base + 3 adapters, with continuous batching and chunked prefill; for all three model
families. Also: unknown adapter, slot and expert limits, name conflicts, unload once the
adapter's requests finish, and a reload into the freed slot.
"""

from __future__ import annotations

import pytest
import torch

from elasticmoe.adapters.esft import EsftAdapter
from elasticmoe.config import EngineConfig, ModelConfig
from elasticmoe.engine.llm_engine import LLMEngine
from elasticmoe.errors import AdapterConflictError, AdapterLimitError, UnknownAdapterError
from elasticmoe.sampling_params import SamplingParams
from elasticmoe.tools.make_esft_adapter import make_esft_adapter, write_merged_model

PROMPTS = [[5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21], [30, 31, 32], [40, 41, 42, 43, 44]]
PARAMS = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=5)
NAMES = ("alpha", "beta", "gamma")


def _engine(model_dir: str, **kwargs) -> LLMEngine:
    # A small token budget forces chunked prefill of the long prompt inside mixed batches.
    config = EngineConfig(model=model_dir, dtype=torch.float32, num_kv_blocks=256, num_threads=1,
                          max_num_batched_tokens=8, **kwargs)
    return LLMEngine(config)


def _run(engine: LLMEngine, requests: list[tuple[str, list[int], str | None]]) -> dict[str, tuple]:
    """request id -> (output token ids, [(token, logprob, top-5 ids)] per step)."""
    for rid, prompt, adapter in requests:
        engine.add_request(rid, prompt, PARAMS, adapter)
    out: dict[str, list] = {rid: [] for rid, _, _ in requests}
    final = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            out[o.request_id] += o.new_logprobs or []
            if o.finished:
                final[o.request_id] = o.output_token_ids
    return {rid: (final[rid], [(lp.token_id, lp.logprob, [t for t, _, _ in lp.top_logprobs]) for lp in out[rid]])
            for rid in out}


def _same(got: tuple, want: tuple) -> None:
    assert got[0] == want[0]
    for (tok, lp, top), (wtok, wlp, wtop) in zip(got[1], want[1], strict=True):
        assert tok == wtok and top == wtop and lp == pytest.approx(wlp, abs=1e-4)


@pytest.fixture(scope="module", params=["qwen3_moe", "mixtral", "deepseek_v2"])
def setup(request, tiny_model_dirs, tmp_path_factory):
    base = tiny_model_dirs[request.param]
    root = tmp_path_factory.mktemp(f"esft-{request.param}")
    adapters, merged = {}, {}
    for seed, name in enumerate(NAMES, start=1):
        path = make_esft_adapter(base, str(root / name), experts_per_layer=2, seed=seed, noise=0.5)
        adapters[name] = EsftAdapter.open(name, path, ModelConfig.from_pretrained(base))
        merged[name] = str(write_merged_model(base, path, str(root / f"{name}-merged")))
    return base, adapters, merged


def _load_all(engine: LLMEngine, adapters: dict[str, EsftAdapter]) -> None:
    for name, a in adapters.items():
        engine.adapters.load_esft(name, a.config.experts, a.expert_weights)


def test_mixed_batch_equals_each_merged_model_alone(setup):
    base, adapters, merged = setup
    engine = _engine(base, max_esft_adapters=3, max_esft_experts=2)
    _load_all(engine, adapters)
    assert engine.adapters.served == NAMES
    requests = [(f"{a or 'base'}-{i}", p, a) for i, p in enumerate(PROMPTS) for a in (None, *NAMES)]
    got = _run(engine, requests)

    reference = {None: _run(_engine(base), [(f"base-{i}", p, None) for i, p in enumerate(PROMPTS)])}
    for name in NAMES:
        reference[name] = _run(_engine(merged[name]), [(f"{name}-{i}", p, None) for i, p in enumerate(PROMPTS)])
    for rid, _prompt, adapter in requests:
        _same(got[rid], reference[adapter][rid])
    # The adapters really change the model (else the test could not fail).
    assert all(reference[n][f"{n}-0"][0] != reference[None]["base-0"][0] for n in NAMES)


def test_adapters_beside_offloaded_experts_equal_each_merged_model(setup):
    """A quarter of the base experts cached (offloading): the adapters' rows stay resident in
    their slots, the base experts come through the cache, and every request of a mixed batch
    equals its merged model alone. One slot for three adapters: the others wait on disk and
    swap in (the disk tier), still exact."""
    base, adapters, merged = setup
    engine = _engine(base, max_esft_adapters=1, max_esft_experts=2, expert_cache_fraction=0.25)
    try:
        for name, a in adapters.items():
            engine.adapters.load_esft(name, a.config.experts, a.expert_weights, files=a)
        requests = [(f"{a or 'base'}-{i}", p, a) for i, p in enumerate(PROMPTS) for a in (None, *NAMES)]
        got = _run(engine, requests)
        stats = engine.offload.stats()
        assert stats["on_demand_loads"] > 0 and stats["resident_experts"] <= engine.offload.cache.capacity
        engine.offload.cache.check_integrity()
        assert engine.adapters.stats()["esft_swaps_in"] >= 2  # three adapters through one slot
    finally:
        engine.offload.close()
    reference = {None: _run(_engine(base), [(f"base-{i}", p, None) for i, p in enumerate(PROMPTS)])}
    for name in NAMES:
        reference[name] = _run(_engine(merged[name]), [(f"{name}-{i}", p, None) for i, p in enumerate(PROMPTS)])
    for rid, _prompt, adapter in requests:
        _same(got[rid], reference[adapter][rid])


def test_errors_limits_unload_and_reload(setup):
    base, adapters, _ = setup
    engine = _engine(base, max_esft_adapters=2, max_esft_experts=2)
    alpha, beta, gamma = (adapters[n] for n in NAMES)
    with pytest.raises(UnknownAdapterError) as info:
        engine.add_request("r0", PROMPTS[1], PARAMS, "alpha")
    assert info.value.param == "model" and "r0" not in engine.requests
    engine.adapters.load_esft("alpha", alpha.config.experts, alpha.expert_weights)
    with pytest.raises(AdapterConflictError):
        engine.adapters.load_esft("alpha", alpha.config.experts, alpha.expert_weights)
    engine.adapters.load_esft("beta", beta.config.experts, beta.expert_weights)
    with pytest.raises(AdapterLimitError, match="2 adapter slots"):
        engine.adapters.load_esft("gamma", gamma.config.experts, gamma.expert_weights)
    too_many = {layer: (0, 1, 2) for layer in gamma.config.experts}
    small = _engine(base, max_esft_adapters=1, max_esft_experts=2)
    with pytest.raises(AdapterLimitError, match="at most 2"):
        small.adapters.load_esft("wide", too_many, gamma.expert_weights)

    # Unload waits for the adapter's running request; new ones are refused meanwhile (and not
    # counted as admitted: the coordinator asks whether a swapped-in adapter's requests arrived).
    assert engine.adapters.admitted("alpha") == 0
    engine.add_request("a1", PROMPTS[1], PARAMS, "alpha")
    engine.step()
    assert engine.adapters.admitted("alpha") == 1 and engine.adapters.admitted("beta") == 0
    assert engine.adapters.unload("alpha") is False
    with pytest.raises(UnknownAdapterError):
        engine.add_request("a2", PROMPTS[1], PARAMS, "alpha")
    assert engine.adapters.admitted("alpha") == 1
    with pytest.raises(AdapterConflictError, match="unloading"):
        engine.adapters.load_esft("alpha", alpha.config.experts, alpha.expert_weights)
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.adapters.served == ("beta",) and engine.adapters.esft.index("alpha") is None
    assert engine.adapters.admitted("alpha") == 0  # released: a later load counts afresh
    # The freed slot takes another adapter, which then serves like its merged model again.
    assert engine.adapters.load_esft("gamma", gamma.config.experts, gamma.expert_weights) == 0
    assert engine.adapters.served == ("gamma", "beta")
    with pytest.raises(UnknownAdapterError):
        engine.adapters.unload("alpha")


def test_discard_undoes_a_load_at_once_and_refuses_while_in_use(setup):
    base, adapters, _ = setup
    engine = _engine(base, max_esft_adapters=1, max_esft_experts=2)
    alpha = adapters["alpha"]
    engine.adapters.load_esft("alpha", alpha.config.experts, alpha.expert_weights)
    engine.add_request("r", PROMPTS[1], PARAMS, "alpha")
    with pytest.raises(AdapterConflictError, match="live requests"):
        engine.adapters.discard("alpha")
    engine.abort("r")
    engine.adapters.discard("alpha")  # no unload was requested: released anyway (a failed load elsewhere)
    assert engine.adapters.served == () and engine.adapters.esft.index("alpha") is None
    engine.adapters.discard("alpha")  # not loaded: nothing to do
    assert engine.adapters.load_esft("alpha", alpha.config.experts, alpha.expert_weights) == 0
    assert engine.adapters.admitted("alpha") == 0  # the aborted request counted for the earlier load only
