"""LoRA adapters in one engine: per-request routing over S fixed slots, one batched LoRA
computation per site for the whole mixed batch (attention q|k|v and o, expert gate|up|down).

Each request's greedy tokens and top-5 logprobs equal those of the merged model
(W + scaling * B @ A) served alone, in mixed batches of base + three LoRA adapters (+ an
ESFT adapter) with chunked prefill; Qwen3-MoE, Mixtral, and DeepSeek-V2 (its MLA projections
q_proj, kv_a_proj_with_mqa and o_proj; kv_b_proj is rejected). Also: limits, unsupported
targets, unload and reuse. DeepSeek-V2 with q_lora_rank: tests/component/test_lora_mla.py.
"""

from __future__ import annotations

import pytest
import torch
from engine_runs import fail_forward_copies

from elasticmoe.adapters.esft import EsftAdapter
from elasticmoe.adapters.lora import LoraAdapter
from elasticmoe.adapters.lora_targets import EXPERT_MODULES, served_modules
from elasticmoe.config import EngineConfig, ModelConfig
from elasticmoe.engine.llm_engine import LLMEngine
from elasticmoe.errors import AdapterConflictError, AdapterError, AdapterLimitError, InvalidRequestError
from elasticmoe.sampling_params import SamplingParams
from elasticmoe.tools.make_esft_adapter import make_esft_adapter
from elasticmoe.tools.make_lora_adapter import make_lora_adapter, write_lora_merged_model

PROMPTS = [[5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21], [30, 31, 32]]
PARAMS = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, logprobs=5)
EXPERT_TARGETS = {"mixtral": ("w1", "w3", "w2")}  # the others: gate_proj, up_proj, down_proj
ATTENTION_TARGETS = {"deepseek_v2": ("q_proj", "kv_a_proj_with_mqa", "o_proj")}  # MLA


def _engine(model_dir: str, **kwargs) -> LLMEngine:
    return LLMEngine(EngineConfig(model=model_dir, dtype=torch.float32, num_kv_blocks=256, num_threads=1,
                                  max_num_batched_tokens=8, **kwargs))


def _run(engine: LLMEngine, requests: list[tuple[str, list[int], str | None]]) -> dict[str, tuple]:
    for rid, prompt, adapter in requests:
        engine.add_request(rid, prompt, PARAMS, adapter)
    steps: dict[str, list] = {}  # every request of the engine, also those added before the call
    final = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            steps.setdefault(o.request_id, []).extend(o.new_logprobs or [])
            if o.finished:
                final[o.request_id] = o.output_token_ids
    return {rid: (final[rid], [(lp.token_id, lp.logprob, [t for t, _, _ in lp.top_logprobs]) for lp in steps[rid]])
            for rid in final}


def _same(got: tuple, want: tuple) -> None:
    assert got[0] == want[0]
    for (tok, lp, top), (wtok, wlp, wtop) in zip(got[1], want[1], strict=True):
        assert tok == wtok and top == wtop and lp == pytest.approx(wlp, abs=1e-4)


def _specs(arch: str) -> dict[str, dict]:
    experts = EXPERT_TARGETS.get(arch, ("gate_proj", "up_proj", "down_proj"))
    specs = {
        "experts": dict(rank=4, target_modules=experts, seed=3),
        "few": dict(rank=2, target_modules=experts[:1] + experts[2:], layers=[1], experts=[0, 3], seed=4,
                    use_rslora=True),
    }
    attention = ATTENTION_TARGETS.get(arch, ("q_proj", "k_proj", "v_proj", "o_proj"))
    specs["attn"] = dict(rank=4, target_modules=attention[::2], seed=1)  # q_proj, v_proj / q_proj, o_proj
    specs["both"] = dict(rank=8, target_modules=(*attention, *experts), seed=2)
    return specs


@pytest.fixture(scope="module", params=["qwen3_moe", "mixtral", "deepseek_v2"])
def setup(request, tiny_model_dirs, tmp_path_factory):
    arch = request.param
    base = tiny_model_dirs[arch]
    root = tmp_path_factory.mktemp(f"lora-{arch}")
    cfg = ModelConfig.from_pretrained(base)
    adapters, merged = {}, {}
    for name, kwargs in _specs(arch).items():
        path = make_lora_adapter(base, str(root / name), **kwargs)
        adapters[name] = LoraAdapter.open(name, path, cfg)
        merged[name] = str(write_lora_merged_model(base, path, str(root / f"{name}-merged")))
    return arch, base, adapters, merged, root


def _load(engine: LLMEngine, adapter: LoraAdapter) -> int:
    return engine.adapters.load_lora(adapter.name, adapter.modules, adapter.weights, adapter.config.scaling)


def test_mixed_batch_equals_each_merged_model_alone(setup):
    arch, base, adapters, merged, root = setup
    engine = _engine(base, max_loras=len(adapters), max_lora_rank=8, max_esft_adapters=1, max_esft_experts=2)
    for a in adapters.values():
        _load(engine, a)
    esft_path = make_esft_adapter(base, str(root / "esft"), experts_per_layer=2, seed=9, noise=0.5)
    esft = EsftAdapter.open("esft", esft_path, ModelConfig.from_pretrained(base))
    engine.adapters.load_esft("esft", esft.config.experts, esft.expert_weights)

    names = list(adapters)
    requests = [(f"{a or 'base'}-{i}", p, a) for i, p in enumerate(PROMPTS) for a in (None, *names)]
    got = _run(engine, requests + [("esft-0", PROMPTS[0], "esft")])

    reference = {None: _run(_engine(base), [(f"base-{i}", p, None) for i, p in enumerate(PROMPTS)])}
    for name in names:
        reference[name] = _run(_engine(merged[name]), [(f"{name}-{i}", p, None) for i, p in enumerate(PROMPTS)])
        # The adapter matters (else the comparison could not fail): other tokens or other logprobs.
        (tokens, steps), (base_tokens, base_steps) = reference[name][f"{name}-0"], reference[None]["base-0"]
        assert tokens != base_tokens or max(abs(a[1] - b[1]) for a, b in zip(steps, base_steps, strict=False)) > 1e-3, name
    for rid, _, adapter in requests:
        _same(got[rid], reference[adapter][rid])
    # The ESFT request in the same batches is unaffected by the LoRA slots (and vice versa).
    esft_alone = _engine(base, max_esft_adapters=1, max_esft_experts=2)
    esft_alone.adapters.load_esft("esft", esft.config.experts, esft.expert_weights)
    _same(got["esft-0"], _run(esft_alone, [("esft-0", PROMPTS[0], "esft")])["esft-0"])


def test_lora_over_offloaded_experts_equals_each_merged_model(setup):
    """A quarter of the experts cached (offloading): adapters on the experts, the attention and
    both in one mixed batch, each request equal to its merged model alone. The LoRA factors stay
    resident and indexed by expert; the base weights come from whichever cache row holds them."""
    arch, base, adapters, merged, root = setup
    engine = _engine(base, max_loras=len(adapters), max_lora_rank=8, expert_cache_fraction=0.25)
    try:
        for a in adapters.values():
            _load(engine, a)
        names = list(adapters)
        requests = [(f"{a or 'base'}-{i}", p, a) for i, p in enumerate(PROMPTS) for a in (None, *names)]
        got = _run(engine, requests)
        stats = engine.offload.stats()
        assert stats["on_demand_loads"] > 0 and stats["evictions"] > 0  # the experts really moved through the cache
    finally:
        engine.offload.close()
    reference = _run(_engine(base), [(f"base-{i}", p, None) for i, p in enumerate(PROMPTS)])
    for name in names:
        reference.update(_run(_engine(merged[name]), [(f"{name}-{i}", p, None) for i, p in enumerate(PROMPTS)]))
    (tokens, steps), (base_tokens, base_steps) = reference["experts-0"], reference["base-0"]
    assert tokens != base_tokens or max(abs(a[1] - b[1]) for a, b in zip(steps, base_steps, strict=False)) > 1e-3
    for rid, _, _ in requests:
        _same(got[rid], reference[rid])


def test_an_unreadable_offloaded_expert_fails_only_the_lora_requests_that_need_it(setup):
    """The disk tier raises for one expert while LoRA requests ride on the experts: the requests
    routed to it finish with an error, the engine and the adapter's slot go on, and once the tier
    reads again the same requests equal the merged model."""
    arch, base, adapters, merged, root = setup
    engine = _engine(base, max_loras=1, max_lora_rank=8, expert_cache_fraction=0.25)
    broken = fail_forward_copies(engine.offload.cache, lambda layer, local: local == 1)  # expert 1 of every layer
    try:
        _load(engine, adapters["experts"])
        for i, prompt in enumerate(PROMPTS):
            engine.add_request(f"e{i}", prompt, PARAMS, "experts")
        finished = {}
        while engine.has_unfinished_requests():
            finished.update({o.request_id: o for o in engine.step() if o.finished})
        assert set(finished) == {"e0", "e1"}
        assert any(o.finish_reason == "error" and "disk read error" in o.error for o in finished.values())
        engine.offload.cache.check_integrity()
        broken["on"] = False
        got = _run(engine, [(f"experts-{i}", p, "experts") for i, p in enumerate(PROMPTS)])
    finally:
        engine.offload.close()
    want = _run(_engine(merged["experts"]), [(f"experts-{i}", p, None) for i, p in enumerate(PROMPTS)])
    for rid in want:
        _same(got[rid], want[rid])


def test_limits_unsupported_targets_unload_and_reuse(setup):
    arch, base, adapters, merged, root = setup
    engine = _engine(base, max_loras=1, max_lora_rank=4)
    few, experts = adapters["few"], adapters["experts"]
    assert _load(engine, few) == 0
    with pytest.raises(AdapterConflictError):
        _load(engine, few)
    with pytest.raises(AdapterError, match="1 LoRA slots") as full:  # the host budget: a 400 naming the field
        _load(engine, experts)
    assert full.value.param == "name" and "--max-cpu-loras" in full.value.message
    assert engine.adapters.unload("few") is True  # no request uses it: gone at once
    if "both" in adapters:
        with pytest.raises(AdapterLimitError, match="rank 8"):
            _load(engine, adapters["both"])  # rank 8 > --max-lora-rank 4
    assert _load(engine, experts) == 0  # the freed slot, cleared first
    got = _run(engine, [("e", PROMPTS[1], "experts")])
    _same(got["e"], _run(_engine(merged["experts"]), [("e", PROMPTS[1], None)])["e"])
    if arch == "deepseek_v2":  # kv_b_proj is absorbed into MLA over cached latents: not a LoRA target
        layer0 = "model.layers.0.self_attn"
        modules = {f"{layer0}.kv_b_proj": (2, 32, 128), f"{layer0}.o_proj": (2, 64, 64)}
        with pytest.raises(AdapterError, match="kv_b_proj cannot be adapted") as info:
            _engine(base, max_loras=1, max_lora_rank=4).adapters.load_lora(
                "kvb", modules, lambda m, dtype: (torch.zeros(2, modules[m][1]), torch.zeros(modules[m][2], 2)), 1.0)
        assert info.value.param == "target_modules"


def test_slots_of_the_attention_modules_only_serve_their_adapters_and_refuse_the_others(setup):
    """`lora_target_modules`: the slots hold the "attn" adapter's two modules only (no expert sites, the
    fused site at two ranks' width), serve it equal to its merged model beside base requests, and
    refuse adapters on other modules (400 naming target_modules, nothing loaded)."""
    arch, base, adapters, merged, root = setup
    attn = adapters["attn"]
    targets = tuple(sorted({path.rsplit(".", 1)[-1] for path in attn.modules}))
    full = _engine(base, max_loras=2, max_lora_rank=4)
    engine = _engine(base, max_loras=2, max_lora_rank=4, lora_target_modules=targets)
    slots = engine.adapters.lora
    assert slots is not None and full.adapters.lora is not None
    assert slots.experts == {} and all(b.lora is None for b in engine.model.moe_blocks())
    assert {name for sites in slots.attention.values() for name in sites} == set(targets)
    assert slots.slot_bytes * 5 < full.adapters.lora.slot_bytes  # the experts' sites were most of a slot
    for other in ("experts", "both"):
        with pytest.raises(AdapterError, match="--lora-target-modules") as info:
            _load(engine, adapters[other])
        assert info.value.param == "target_modules"
    assert slots.names == []
    assert _load(engine, attn) == 0
    got = _run(engine, [("a", PROMPTS[0], "attn"), ("b", PROMPTS[1], None)])
    _same(got["a"], _run(_engine(merged["attn"]), [("a", PROMPTS[0], None)])["a"])
    _same(got["b"], _run(_engine(base), [("b", PROMPTS[1], None)])["b"])


def test_the_modules_a_config_names_are_those_the_slots_of_every_module_have(tiny_model_dirs, qlora_base):
    """`served_modules(config)` (what the settings check names against before anything starts) is what
    the slots of the built model hold, for every family and for MLA with q_lora_rank."""
    for base in (*tiny_model_dirs.values(), qlora_base):
        slots = _engine(base, max_loras=1, max_lora_rank=4).adapters.lora
        assert slots is not None
        held = {name for sites in slots.attention.values() for name in sites}
        held |= set(EXPERT_MODULES) if slots.experts else set()
        assert set(served_modules(ModelConfig.from_pretrained(base))) == held, base


@pytest.mark.parametrize("targets, match", [(("q_a_proj",), "this model has no q_a_proj"),
                                            (("q_proj", "bogus"), "want distinct names"),
                                            ((), "want distinct names")])
def test_target_modules_the_model_lacks_are_refused_at_start(tiny_model_dir, targets, match):
    with pytest.raises(ValueError, match=match) as info:
        _engine(tiny_model_dir, max_loras=1, lora_target_modules=targets)
    assert "lora_target_modules" in str(info.value)


def test_more_adapters_than_slots_swaps_and_never_blocks_resident_requests(setup):
    arch, base, adapters, merged, root = setup
    names = list(adapters)
    engine = _engine(base, max_loras=1, max_lora_rank=8, max_cpu_loras=len(names))
    for a in adapters.values():
        _load(engine, a)
    first, second = names[0], names[1]
    assert engine.adapters.stats()["resident"] == 1 and engine.adapters.lora.index(first) == 0

    # `first` runs; a request for `second` (host memory only, and the one slot is busy) arrives
    # before another request for `first`: that one starts at once, `second` waits for a slot.
    engine.add_request("f1", PROMPTS[1], PARAMS, first)  # short: decoding after one step
    engine.step()
    engine.add_request("s1", PROMPTS[1], PARAMS, second)
    engine.add_request("f2", PROMPTS[1], PARAMS, first)
    engine.step()
    assert engine.requests["f2"].status.name == "RUNNING"
    assert engine.requests["s1"].status.name == "WAITING" and not engine.requests["s1"].is_ready
    while engine.has_unfinished_requests():
        engine.step()

    # Every adapter, interleaved, through one slot: all complete, each equal to its merged model.
    requests = [(f"{n}-{i}", p, n) for i, p in enumerate(PROMPTS) for n in names]
    got = _run(engine, requests)
    for rid, prompt, name in requests:
        _same(got[rid], _run(_engine(merged[name]), [(rid, prompt, None)])[rid])
    stats = engine.adapters.stats()
    assert stats["swaps_in"] >= len(names) and stats["evictions"] >= len(names) - 1 and stats["misses"] > 0


def test_swaps_are_requested_only_for_the_scheduling_window(setup):
    arch, base, adapters, merged, root = setup
    names = list(adapters)  # experts, few (resident), attn, both (host memory only)
    engine = _engine(base, max_loras=2, max_lora_rank=8, max_cpu_loras=len(names), scheduling_window=2)
    for a in adapters.values():
        _load(engine, a)
    engine.add_request("a", PROMPTS[1], PARAMS, names[2])
    engine.add_request("r", PROMPTS[1], PARAMS, names[0])
    engine.add_request("b", PROMPTS[1], PARAMS, names[3])  # behind the window of two
    engine.step()
    lora = engine.adapters.lora
    assert lora.index(names[2]) is not None or lora.is_filling(names[2])
    assert lora.index(names[3]) is None and not lora.is_filling(names[3])
    assert engine.requests["r"].status.name == "RUNNING"
    got = _run(engine, [])
    assert set(got) == {"a", "r", "b"}  # the later one still gets its slot once it enters the window


def test_per_token_vocabulary_routing_equals_each_token_through_its_adapter(setup):
    """MoLoRA §3.1/3.2: a request's tokens go to adapters by token-id range, in a mixed batch with
    a per-request LoRA request and base. Reference: one token per step, the request's slot set
    to the adapter of the token being processed (the per-request path, verified above)."""
    arch, base, adapters, merged, root = setup
    first, second = list(adapters)[:2]
    vocab = ModelConfig.from_pretrained(base).vocab_size
    half = vocab // 2
    prompt = [3, half + 5, 7, half + 9, 11, 13, half + 1, 2, 4, half + 20]  # both ranges
    routing = {"type": "vocab", "breaks": [half], "adapters": [first, second]}
    compositional = {"type": "vocab", "breaks": [half], "adapters": [None, first]}  # another customer's table

    got = _run(_engine(base), [("tok", prompt, None)])  # the base model alone
    engine2 = _engine(base, max_loras=2, max_lora_rank=8)
    for name in (first, second):
        _load(engine2, adapters[name])
    engine2.add_request("tok", prompt, PARAMS, lora_routing=routing)
    engine2.add_request("comp", prompt, PARAMS, lora_routing=compositional)
    engine2.add_request("plain", PROMPTS[1], PARAMS, first)
    mixed = _run(engine2, [])

    def reference(table: list[str | None]) -> tuple:
        ref = _engine(base, max_loras=2, max_lora_rank=8)
        ref.scheduler.max_num_batched_tokens = 1  # one token per step: its slot can follow its id
        slots = {}
        for name in (first, second):
            slots[name] = _load(ref, adapters[name])
        ref.add_request("r", prompt, PARAMS, first)
        outs, final = [], None
        while ref.has_unfinished_requests():
            r = ref.requests["r"]
            token = r.token_ids[r.num_computed_tokens]
            name = table[0] if token < half else table[1]
            r.binding.lora_slot = -1 if name is None else slots[name]
            for o in ref.step():
                outs += o.new_logprobs or []
                final = o.output_token_ids if o.finished else final
        return final, [(lp.token_id, lp.logprob, [t for t, _, _ in lp.top_logprobs]) for lp in outs]

    _same(mixed["tok"], reference([first, second]))
    _same(mixed["comp"], reference([None, first]))
    assert mixed["tok"][0] != got["tok"][0] or mixed["tok"][1] != got["tok"][1]  # routing changed the output


def test_learned_router_top1_equals_the_adapter_it_picks(setup, tmp_path):
    """A learned router (MoLoRA §4.3) whose logits always favour one adapter serves exactly that
    adapter's merged model; a loaded router survives a round trip through its files."""
    from elasticmoe.adapters.lora_router import LoraRouter, random_router

    arch, base, adapters, merged, root = setup
    first, second = list(adapters)[:2]
    cfg = ModelConfig.from_pretrained(base)
    router = random_router((second, first), cfg.hidden_size, top_k=1, seed=2)
    router = LoraRouter(router.adapters, 1, router.w1, router.b1, torch.zeros_like(router.w2),
                        torch.tensor([0.0, 50.0]))  # logits independent of x: always `first`
    router = LoraRouter.open(router.save(tmp_path / "router"))
    engine = _engine(base, max_loras=2, max_lora_rank=8)
    for name in (first, second):
        _load(engine, adapters[name])
    engine.adapters.load_router("r", router)
    engine.add_request("learned", PROMPTS[0], PARAMS, lora_routing={"type": "learned", "router": "r"})
    got = _run(engine, [("plain", PROMPTS[1], second)])
    _same(got["learned"], _run(_engine(merged[first]), [("learned", PROMPTS[0], None)])["learned"])
    _same(got["plain"], _run(_engine(merged[second]), [("plain", PROMPTS[1], None)])["plain"])
    with pytest.raises(InvalidRequestError, match="router 'nope'"):
        engine.add_request("x", PROMPTS[1], PARAMS, lora_routing={"type": "learned", "router": "nope"})


def test_unload_waits_for_per_token_requests_of_the_adapter(setup):
    arch, base, adapters, merged, root = setup
    first, second = list(adapters)[:2]
    engine = _engine(base, max_loras=2, max_lora_rank=8)
    for name in (first, second):
        _load(engine, adapters[name])
    half = ModelConfig.from_pretrained(base).vocab_size // 2
    engine.add_request("tok", PROMPTS[0], PARAMS, lora_routing={"breaks": [half], "adapters": [None, second]})
    engine.step()
    assert engine.adapters.unload(second) is False  # the per-token request still routes to it
    while engine.has_unfinished_requests():
        engine.step()
    assert second not in engine.adapters.served and engine.adapters.lora.is_loaded(second) is False


@pytest.fixture(scope="module")
def qlora_base(tiny_model_dirs, tmp_path_factory) -> str:
    """The tiny DeepSeek-V2 with a low-rank query (q_a_proj -> norm -> q_b_proj), as in DeepSeek-V2 itself."""
    from unittest.mock import patch

    from elasticmoe.tools import make_model as mm

    preset = {**mm.PRESETS["deepseek_v2"]["tiny"], "q_lora_rank": 24}
    with (patch.dict(mm.PRESETS["deepseek_v2"], {"tiny-q": preset}), patch.dict(mm._INIT_STD, {"tiny-q": 0.08}),
          patch.dict(mm._SAVE_DTYPE, {"tiny-q": "float32"})):
        return str(mm.make_model("deepseek_v2", "tiny-q", seed=1, out=str(tmp_path_factory.mktemp("ds-q") / "m")))


def test_mla_with_q_lora_rank_mixed_batch_equals_merged_models(qlora_base, tmp_path):
    """q_a_proj, q_b_proj (after the q_a norm), kv_a_proj_with_mqa (its delta reaches the cached latents
    that later decode steps attend to through the absorbed kv_b_proj) and o_proj, with and without experts."""
    base = qlora_base
    assert ModelConfig.from_pretrained(base).q_lora_rank == 24
    specs = {"mla": dict(rank=4, target_modules=("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "o_proj"), seed=6),
             "mla-experts": dict(rank=8, target_modules=("q_b_proj", "kv_a_proj_with_mqa", "gate_proj", "down_proj"),
                                 seed=7)}
    engine = _engine(base, max_loras=2, max_lora_rank=8)
    reference = {None: _run(_engine(base), [(f"base-{i}", p, None) for i, p in enumerate(PROMPTS)])}
    for name, kwargs in specs.items():
        path = make_lora_adapter(base, str(tmp_path / name), **kwargs)
        _load(engine, LoraAdapter.open(name, path, ModelConfig.from_pretrained(base)))
        merged = str(write_lora_merged_model(base, path, str(tmp_path / f"{name}-merged")))
        reference[name] = _run(_engine(merged), [(f"{name}-{i}", p, None) for i, p in enumerate(PROMPTS)])
        assert reference[name][f"{name}-0"] != reference[None]["base-0"], name
    requests = [(f"{a or 'base'}-{i}", p, a) for i, p in enumerate(PROMPTS) for a in (None, *specs)]
    got = _run(engine, requests)
    for rid, _, adapter in requests:
        _same(got[rid], reference[adapter][rid])
