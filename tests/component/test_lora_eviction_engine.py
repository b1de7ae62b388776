"""The engine's LoRA hot set under CoServe's eviction (§4.3) and its baselines: usage probabilities
declared at load or read from a profile decide the victim; `lru` follows recency instead. Real
engine, tiny Qwen3-MoE, three adapters over two slots."""

from __future__ import annotations

import random

import pytest
import torch

from elasticmoe.adapter_policy.profile import KindProfile, Profile
from elasticmoe.adapters.lora import LoraAdapter
from elasticmoe.config import EngineConfig, ModelConfig
from elasticmoe.engine.llm_engine import LLMEngine
from elasticmoe.sampling_params import SamplingParams
from elasticmoe.tools.make_lora_adapter import make_lora_adapter

PARAMS = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
NAMES = ("x", "y", "z")


@pytest.fixture(scope="module")
def adapters(tiny_model_dir, tmp_path_factory) -> dict[str, LoraAdapter]:
    root = tmp_path_factory.mktemp("lora-eviction")
    cfg = ModelConfig.from_pretrained(tiny_model_dir)
    return {n: LoraAdapter.open(n, make_lora_adapter(tiny_model_dir, str(root / n), rank=2,
                                                     target_modules=("q_proj", "v_proj"), seed=i + 1), cfg)
            for i, n in enumerate(NAMES)}


def make_engine(model_dir: str, adapters: dict[str, LoraAdapter], usage: dict[str, float | None],
                max_loras: int = 2, num_kv_blocks: int = 64, **options) -> LLMEngine:
    engine = LLMEngine(EngineConfig(model=model_dir, dtype=torch.float32, num_kv_blocks=num_kv_blocks, num_threads=1,
                                    max_loras=max_loras, max_lora_rank=2, max_cpu_loras=3, **options))
    for name, a in adapters.items():
        engine.adapters.load_lora(name, a.modules, a.weights, a.config.scaling, usage_probability=usage.get(name))
    return engine


def serve(engine: LLMEngine, request_id: str, adapter: str) -> None:
    engine.add_request(request_id, [5, 6, 7], PARAMS, adapter)
    while engine.has_unfinished_requests():
        engine.step()
    engine.adapters.swapper.lora.finish_swaps(block=True)


def logprobs(engine: LLMEngine, adapter: str | None) -> list[float]:
    """The greedy tokens' logprobs of one request for `adapter`, run alone to its end (its swap done)."""
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True, logprobs=0)
    engine.add_request(f"{adapter}-0", [5, 6, 7], params, adapter)
    out = []
    while engine.has_unfinished_requests():
        out += [lp.logprob for o in engine.step() for lp in o.new_logprobs or []]
    engine.adapters.swapper.lora.finish_swaps(block=True)
    return out


def resident(engine: LLMEngine) -> set[str]:
    return set(engine.adapters.lora.slot_of)


def test_declared_probabilities_decide_the_victim_where_lru_uses_recency(tiny_model_dir, adapters):
    usage = {"x": 0.6, "y": 0.1, "z": 0.3}
    for eviction in ("lru", "fifo"):
        engine = make_engine(tiny_model_dir, adapters, usage, adapter_eviction=eviction)
        assert resident(engine) == {"x", "y"}  # loaded into the free slots, in order
        serve(engine, "y-0", "y")  # y is the most recently used
        serve(engine, "z-0", "z")
        assert resident(engine) == {"y", "z"}, eviction
        assert engine.adapters.stats()["evictions"] == 1 and engine.adapters.stats()["preloads"] == 0
    # CoServe: z, registered with the slots full, is more probable than y: it is preloaded in y's
    # place at once (§4.1 while the server runs). y's request then displaces z, the less probable
    # resident, and once it finished z comes back.
    engine = make_engine(tiny_model_dir, adapters, usage, adapter_eviction="coserve")
    engine.adapters.lora.finish_swaps(block=True)
    assert resident(engine) == {"x", "z"} and engine.adapters.stats()["preloads"] == 1
    serve(engine, "y-0", "y")
    assert resident(engine) == {"x", "z"}
    assert {k: engine.adapters.stats()[k] for k in ("preloads", "evictions", "hits", "misses")} == {
        "preloads": 2, "evictions": 3, "hits": 0, "misses": 1}


def test_a_preloaded_adapter_serves_its_request_as_a_hit_with_its_own_weights(tiny_model_dir, adapters):
    engine = make_engine(tiny_model_dir, adapters, {"x": 0.6, "y": 0.1, "z": 0.3})
    engine.adapters.lora.finish_swaps(block=True)  # z preloaded in y's slot (slot 1) at its load
    assert engine.adapters.lora.slot_of == {"x": 0, "z": 1}
    preloaded = logprobs(engine, "z")
    assert engine.adapters.stats()["hits"] == 1 and engine.adapters.stats()["misses"] == 0
    alone = make_engine(tiny_model_dir, {"z": adapters["z"]}, {})  # z in slot 0 from its load
    assert preloaded == pytest.approx(logprobs(alone, "z"), abs=1e-5)
    assert preloaded != pytest.approx(logprobs(alone, None), abs=1e-5)  # the adapter changes them


def test_registrations_on_an_idle_engine_preload_one_after_another(tiny_model_dir, adapters):
    # One slot. Each registration finds the previous preload's copy done (no step ran to collect
    # it) and replaces that adapter, unused since, with the likelier one just registered.
    engine = LLMEngine(EngineConfig(model=tiny_model_dir, dtype=torch.float32, num_kv_blocks=64, num_threads=1,
                                    max_loras=1, max_lora_rank=2, max_cpu_loras=3))
    lora = engine.adapters.lora
    for name, p in (("x", 0.1), ("y", 0.3), ("z", 0.6)):
        a = adapters[name]
        engine.adapters.load_lora(name, a.modules, a.weights, a.config.scaling, usage_probability=p)
        lora.wait_for_a_swap()
    lora.finish_swaps(block=True)
    assert lora.slot_of == {"z": 0} and engine.adapters.stats()["preloads"] == 2
    serve(engine, "z-0", "z")
    assert engine.adapters.stats()["hits"] == 1 and engine.adapters.stats()["misses"] == 0


def _break_copies_of(monkeypatch, engine: LLMEngine, broken: str) -> list[int]:
    """Copies of adapter `broken` into a slot raise (host memory gone bad, a bug): `LoraSlots._write`.
    Returns the slots its copies were tried into, as they are."""
    lora = engine.adapters.lora
    write, tried = lora._write, []

    def write_or_fail(name: str, slot: int) -> None:
        if name == broken:
            tried.append(slot)
            raise OSError(f"injected: copying {name} failed")
        write(name, slot)

    monkeypatch.setattr(lora, "_write", write_or_fail)
    return tried


@pytest.mark.parametrize("background_copies", [True, False])
def test_a_failed_copy_fails_only_the_requests_waiting_for_that_adapter(tiny_model_dir, adapters, monkeypatch,
                                                                        background_copies):
    """On the copy thread or the step thread alike (the host's cores choose: `copier_has_a_core`)."""
    engine = make_engine(tiny_model_dir, adapters, {})  # x and y in the slots, z in host memory
    engine.adapters.swapper.async_swaps = background_copies
    _break_copies_of(monkeypatch, engine, "z")
    engine.add_request("z-0", [5, 6, 7], PARAMS, "z")
    engine.add_request("x-0", [5, 6, 7], PARAMS, "x")
    finished = {}
    while engine.has_unfinished_requests():
        finished.update({o.request_id: o for o in engine.step() if o.finished})
    assert finished["z-0"].finish_reason == "error" and "injected" in finished["z-0"].error
    assert finished["x-0"].finish_reason == "length"
    lora = engine.adapters.lora
    assert "z" not in lora.slot_of and not lora.filling and not lora.failed_swaps
    monkeypatch.undo()
    serve(engine, "z-1", "z")  # still registered: a later request swaps it in
    assert "z" in lora.slot_of


@pytest.mark.parametrize("background_copies", [True, False])
def test_a_failed_preload_is_logged_and_not_tried_again(tiny_model_dir, adapters, monkeypatch, caplog,
                                                        background_copies):
    engine = make_engine(tiny_model_dir, {n: adapters[n] for n in ("x", "y")}, {"x": 0.1, "y": 0.2})
    engine.adapters.swapper.async_swaps = background_copies
    tried = _break_copies_of(monkeypatch, engine, "z")
    z = adapters["z"]
    engine.adapters.load_lora("z", z.modules, z.weights, z.config.scaling, usage_probability=0.6)
    lora = engine.adapters.lora
    lora.finish_swaps(block=True)  # the preload's copy, in x's slot, raised
    assert "z" in lora.failed_swaps and lora.slot_of == {"y": 1}
    serve(engine, "y-0", "y")  # y's request is unaffected; x is preloaded back into the free slot
    assert lora.slot_of == {"x": 0, "y": 1} and engine.adapters.stats()["preloads"] == 2
    assert tried == [0]  # z was not tried again
    assert any("copying adapter 'z' into slot 0 failed" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("eviction", ["coserve", "lru", "fifo"])
@pytest.mark.parametrize("background_copies", [True, False])
def test_a_queue_behind_the_window_over_more_adapters_than_slots_drains(tiny_model_dir, adapters, eviction,
                                                                        background_copies):
    # One slot, a window of one, one request running at a time: each swap evicts an adapter that
    # requests behind the window wait for, and brings it back later for the first of them. Every
    # request must finish. (With copies on the engine thread the engine stalled: a request that
    # found its adapter resident when it reached the window was never given its slot.)
    engine = make_engine(tiny_model_dir, adapters, {"x": 0.5, "y": 0.3, "z": 0.2}, max_loras=1,
                         adapter_eviction=eviction, scheduling_window=1, max_num_seqs=1)
    engine.adapters.swapper.async_swaps = background_copies
    order = "yxxzxyyzxx"
    for i, adapter in enumerate(order):
        engine.add_request(f"{adapter}-{i}", [5, 6, 7], PARAMS, adapter)
    finished = set()
    for _ in range(200):
        finished |= {o.request_id for o in engine.step() if o.finished}
        if not engine.has_unfinished_requests():
            break
    assert finished == {f"{a}-{i}" for i, a in enumerate(order)}, engine.adapters.stats()


@pytest.mark.parametrize("eviction", ["coserve", "lru", "fifo"])
@pytest.mark.parametrize("background_copies", [True, False])
def test_random_arrivals_aborts_and_preemptions_over_few_slots_never_stall_the_engine(
        tiny_model_dir, adapters, eviction, background_copies):
    # Requests for the base model and three adapters over one or two slots arrive between steps,
    # some are aborted (waiting, running, or waiting for a copy), and a small KV pool preempts.
    # Every request that was not aborted finishes with all of its tokens, an aborted one reports
    # nothing more, and the engine ends idle with no copy left in flight.
    rng = random.Random(f"{eviction}-{background_copies}")
    for trial in range(3):
        engine = make_engine(tiny_model_dir, adapters, {"x": 0.5, "y": 0.3, "z": 0.2}, max_loras=rng.randint(1, 2),
                             adapter_eviction=eviction, scheduling_window=rng.randint(1, 4),
                             max_num_seqs=rng.randint(2, 6), num_kv_blocks=4, block_size=4)
        engine.adapters.swapper.async_swaps = background_copies
        arrivals = [(f"{trial}-{i}", rng.choice([None, "x", "y", "z"]), rng.randint(1, 6)) for i in range(24)]
        arrivals.reverse()
        live: dict[str, int] = {}  # request id -> tokens it must produce
        done: dict[str, list[int]] = {}
        aborted: set[str] = set()
        for _ in range(1000):
            if arrivals and rng.random() < 0.5:
                rid, adapter, max_tokens = arrivals.pop()
                engine.add_request(rid, [5, 6, 7, 8], SamplingParams(temperature=0.0, max_tokens=max_tokens,
                                                                     ignore_eos=True), adapter)
                live[rid] = max_tokens
            if live and rng.random() < 0.05:
                rid = rng.choice(sorted(live))
                engine.abort(rid)
                aborted.add(rid)
                del live[rid]
            for o in engine.step():
                assert o.request_id not in aborted, o
                if o.finished:
                    assert o.finish_reason == "length" and len(o.output_token_ids) == live.pop(o.request_id), o
                    done[o.request_id] = o.output_token_ids
            if not arrivals and not engine.has_unfinished_requests():
                break
        assert not arrivals and not live and not engine.has_unfinished_requests(), engine.adapters.stats()
        engine.adapters.lora.finish_swaps(block=True)
        assert not engine.adapters.lora.filling and len(done) + len(aborted) == 24


def test_a_profile_outranks_the_declaration_and_declarations_are_checked(tiny_model_dir, adapters, tmp_path):
    profile = Profile("tiny", "cpu", {"base": KindProfile(4, 0.01, 0.01), "lora": KindProfile(4, 0.01, 0.01)},
                      kv_bytes_per_token=64, tokens_per_request=8, usage_probability={"x": 0.05},
                      adapter_kind={"x": "lora"})
    path = profile.save(tmp_path / "profile.json")
    engine = make_engine(tiny_model_dir, adapters, {"x": 0.6, "y": 0.1, "z": 0.3}, adapter_profile=str(path))
    serve(engine, "z-0", "z")
    assert resident(engine) == {"y", "z"}  # x is the rarest by the profile, whatever was declared
    assert {d["name"]: d.get("usage_probability") for d in engine.adapters.describe()} == {
        "x": 0.6, "y": 0.1, "z": 0.3}
    bad = make_engine(tiny_model_dir, {}, {})
    with pytest.raises(ValueError, match="usage_probability"):
        bad.adapters.load_lora("x", adapters["x"].modules, adapters["x"].weights, 1.0, usage_probability=2.0)
    assert not bad.adapters.lora.is_loaded("x")
    with pytest.raises(ValueError, match="adapter_eviction"):
        EngineConfig(model=tiny_model_dir, adapter_eviction="random")


def test_outputs_say_whether_the_request_waited_for_its_adapter(tiny_model_dir, adapters):
    """A request for a resident adapter (or the base model) never waited; one whose adapter had to
    be swapped in says so in every output, and the flag survives the rank stream's deltas."""
    from elasticmoe.outputs import OutputAccumulator, OutputDelta

    engine = make_engine(tiny_model_dir, adapters, {}, adapter_eviction="lru")
    assert resident(engine) == {"x", "y"}

    def outputs(request_id: str, adapter: str | None) -> list:
        engine.add_request(request_id, [5, 6, 7], PARAMS, adapter)
        got = []
        while engine.has_unfinished_requests():
            got += engine.step()
        engine.adapters.swapper.lora.finish_swaps(block=True)
        return got

    for request_id, adapter, waited in (("x-0", "x", False), ("base-0", None, False), ("z-0", "z", True)):
        outs = outputs(request_id, adapter)
        assert outs and outs[-1].finished
        assert {o.waited_for_adapter for o in outs} == {waited}, request_id
        receiver = OutputAccumulator([5, 6, 7])
        rebuilt = [receiver.add(OutputDelta.of(o)) for o in outs]
        assert rebuilt[-1].waited_for_adapter is waited and rebuilt[-1].output_token_ids == outs[-1].output_token_ids
    assert engine.adapters.stats()["misses"] == 1
    # The receiver keeps the flag once set (an ingress that saw the request wait before routing it).
    receiver = OutputAccumulator([5])
    receiver.waited_for_adapter = True
    assert receiver.add(OutputDelta("r", [1], "a")).waited_for_adapter


def test_a_slot_reused_by_an_adapter_of_fewer_modules_holds_nothing_of_the_last(tiny_model_dir, adapters, tmp_path):
    """Eviction no longer zeroes the slot (the next write clears it first): an adapter that
    targets only q_proj, written where x (q and v) was, computes as it does alone."""
    cfg = ModelConfig.from_pretrained(tiny_model_dir)
    only_q = LoraAdapter.open("q", make_lora_adapter(tiny_model_dir, str(tmp_path / "q"), rank=2,
                                                     target_modules=("q_proj",), seed=9), cfg)

    engine = make_engine(tiny_model_dir, {"x": adapters["x"], "q": only_q}, {}, max_loras=1, adapter_eviction="lru")
    assert resident(engine) == {"x"}
    logprobs(engine, "x")
    swapped_in = logprobs(engine, "q")  # evicts x, writes q into its slot
    assert resident(engine) == {"q"}
    alone = make_engine(tiny_model_dir, {"q": only_q}, {}, max_loras=1)
    assert swapped_in == pytest.approx(logprobs(alone, "q"), abs=1e-6)


def test_the_dependency_graph_is_built_again_only_when_the_adapters_change(tiny_model_dir, adapters):
    engine = make_engine(tiny_model_dir, {n: adapters[n] for n in ("x", "y")}, {})
    swapper = engine.adapters.swapper
    graph = swapper.tier_view().graph
    assert swapper.tier_view().graph is graph  # eviction decisions reuse it
    a = adapters["z"]
    engine.adapters.load_lora("z", a.modules, a.weights, a.config.scaling)
    rebuilt = swapper.tier_view().graph
    assert rebuilt is not graph and set(rebuilt.nodes) == {"x", "y", "z"}
