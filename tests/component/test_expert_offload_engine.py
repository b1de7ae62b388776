"""Expert offloading in the engine (FineMoE, issue 16): with a cache of 25% of the experts the
outputs equal the fully resident run's, for every family, every policy, EP=1 and EP=2; the cache
stays within its budget; a budget that could never run is refused; a tier that fails a read costs
only the requests that needed the expert."""

from __future__ import annotations

import logging
import os
import shutil
import threading
from collections import Counter

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from engine_runs import fail_forward_copies, greedy_run

from elasticmoe.config import EngineConfig, ModelConfig
from elasticmoe.engine.llm_engine import LLMEngine
from elasticmoe.models.weights import SafetensorsWeightProvider
from elasticmoe.sampling_params import SamplingParams
from elasticmoe.utils.ports import free_port

PROMPTS = [[5, 6, 7, 8, 9] * 6, list(range(40, 61)), [3, 4], [100, 200, 300]]
MAX_TOKENS = 10
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)


def _engine(model_dir: str, **offload) -> LLMEngine:
    return LLMEngine(EngineConfig(model=model_dir, dtype=torch.float32, num_threads=1, **offload))


def _run(engine: LLMEngine, prompts=PROMPTS, group=None) -> tuple[dict[str, list[int]], list[torch.Tensor]]:
    return greedy_run(engine, prompts, MAX_TOKENS, group)


@pytest.fixture(scope="module")
def resident(tiny_model_dirs):
    """arch -> (tokens, logits) of the fully resident engine."""
    return {arch: _run(_engine(path)) for arch, path in tiny_model_dirs.items()}


def _assert_same(got, want) -> None:
    tokens, logits = got
    assert tokens == want[0]
    assert len(logits) == len(want[1])
    for a, b in zip(logits, want[1], strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5)


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral", "deepseek_v2"])
def test_quarter_of_the_experts_gives_the_resident_outputs(arch, tiny_model_dirs, resident):
    engine = _engine(tiny_model_dirs[arch], expert_cache_fraction=0.25)
    try:
        _assert_same(_run(engine), resident[arch])
        stats = engine.offload.stats()
        assert stats["on_demand_loads"] > 0 and stats["bytes_loaded_disk"] > 0  # it really offloaded
        assert stats["resident_experts"] <= stats["capacity_experts"]
        engine.offload.cache.check_integrity()
        # Only the pool holds routed experts: the engine loaded none of the stacks itself.
        assert not any(name.endswith((".w13", ".w2")) and ".moe." in name for name in engine.weights)
    finally:
        engine.offload.close()


@pytest.mark.parametrize("policy", ["finemoe", "lru", "lfu", "on_demand"])
def test_every_policy_gives_the_resident_outputs(policy, tiny_model_dirs, resident):
    engine = _engine(tiny_model_dirs["qwen3_moe"], expert_cache_fraction=0.25, offload_policy=policy)
    try:
        _assert_same(_run(engine), resident["qwen3_moe"])
        if policy in ("finemoe", "lfu"):  # a second round: their stores have history now
            _assert_same(_run(engine), resident["qwen3_moe"])
        assert engine.offload.stats()["policy"] == policy
        engine.offload.cache.check_integrity()
    finally:
        engine.offload.close()


def test_dropping_each_reads_pages_from_the_page_cache_gives_the_resident_outputs(tiny_model_dir, resident):
    engine = _engine(tiny_model_dir, expert_cache_fraction=0.25, expert_page_cache="drop")
    try:
        assert engine.offload.cache.source.drops_pages  # tests/unit/test_disk_page_cache.py: what it drops
        _assert_same(_run(engine), resident["qwen3_moe"])
        assert engine.offload.stats()["on_demand_loads"] > 0
    finally:
        engine.offload.close()
    with pytest.raises(ValueError, match="expert_page_cache: unknown 'never'"):
        _engine(tiny_model_dir, expert_cache_fraction=0.5, expert_page_cache="never")


@pytest.mark.parametrize("policy_thread", [True, False], ids=["beside", "inline"])
def test_the_policy_runs_beside_the_forward_or_on_it_in_layer_order(policy_thread, tiny_model_dir, resident,
                                                                     caplog):
    """On its thread (the default) or on the forward's, the policy sees every iteration's layers in
    order, once each (FineMoE's `observe_layer` refuses any other order, which would be logged),
    and each layer's observation and plan come after that layer's experts were ensured (a plan
    made before would queue copies that the layer's own loads cancel, and protect nothing)."""
    engine = _engine(tiny_model_dir, expert_cache_fraction=0.25, offload_policy="finemoe",
                     offload_policy_thread=policy_thread)
    policy, cache = engine.offload.policy, engine.offload.cache
    threads: set[str] = set()
    ensured, observed, early = Counter(), Counter(), []
    observe, ensure = policy.observe_layer, cache.ensure

    def recording(layer, *args):
        threads.add(threading.current_thread().name)
        observed[layer] += 1
        if observed[layer] > ensured[layer]:
            early.append(layer)
        return observe(layer, *args)

    def recording_ensure(layer, experts):
        ensured[layer] += 1
        return ensure(layer, experts)

    policy.observe_layer, cache.ensure = recording, recording_ensure
    try:
        with caplog.at_level(logging.ERROR):
            _assert_same(_run(engine), resident["qwen3_moe"])
            _assert_same(_run(engine), resident["qwen3_moe"])  # with the store's maps
            engine.offload.drain()
        assert threads == ({"expert-policy"} if policy_thread else {threading.current_thread().name})
        assert sum(observed.values()) > 0 and early == []
        assert "failed" not in caplog.text
        stats = engine.offload.stats()
        assert stats["policy_s"] > 0 and stats["lookups"] > 0
        engine.offload.cache.check_integrity()
    finally:
        engine.offload.close()


@pytest.mark.parametrize("policy_thread", [True, False], ids=["beside", "inline"])
@pytest.mark.parametrize("method", ["begin_iteration", "observe_layer", "prefetch_plan", "end_iteration"])
def test_a_policy_that_raises_costs_prefetching_never_a_request(method, policy_thread, tiny_model_dir, resident,
                                                                 caplog):
    engine = _engine(tiny_model_dir, expert_cache_fraction=0.25, offload_policy="finemoe",
                     offload_policy_thread=policy_thread)
    policy = engine.offload.policy
    calls = 0
    original = getattr(policy, method)

    def sometimes_raising(*args, **kwargs):
        nonlocal calls
        calls += 1
        if calls % 3 == 0:
            raise RuntimeError(f"{method} broke")
        return original(*args, **kwargs)

    setattr(policy, method, sometimes_raising)
    try:
        with caplog.at_level(logging.ERROR):
            _assert_same(_run(engine), resident["qwen3_moe"])
            engine.offload.drain()
        assert f"{method} broke" in caplog.text
        assert engine.step() == [] and not engine.has_unfinished_requests()  # the engine goes on
        engine.offload.cache.check_integrity()
    finally:
        engine.offload.close()
    # Closed: the policy's thread is gone; its jobs would run inline, none is left.
    assert engine.offload._worker is None or not engine.offload._worker.busy


def test_the_pytorch_path_without_the_grouped_kernel_gives_the_resident_outputs(tiny_model_dirs, resident,
                                                                                monkeypatch):
    # Where the grouped kernel does not serve a call (no compiler, ELASTICMOE_KERNELS=0), rows go
    # through the pool rows sorted, then back; a cache of 10% makes layers run in waves too.
    monkeypatch.setattr("elasticmoe.engine.expert_offload.grouped_experts_at_rows", lambda *args: None)
    engine = _engine(tiny_model_dirs["qwen3_moe"], expert_cache_fraction=0.1)
    try:
        _assert_same(_run(engine), resident["qwen3_moe"])
        engine.offload.cache.check_integrity()
    finally:
        engine.offload.close()


def test_an_engine_given_a_provider_copies_from_its_stacks(tiny_model_dir, resident):
    """The elastic server's ranks get their weights from the HMM through a provider: the cache then
    copies experts from the provider's stacks (host tier), the stacks themselves are not the pool."""
    engine = LLMEngine(EngineConfig(model=tiny_model_dir, dtype=torch.float32, num_threads=1,
                                    expert_cache_fraction=0.25),
                       weight_provider=SafetensorsWeightProvider(tiny_model_dir))
    try:
        _assert_same(_run(engine), resident["qwen3_moe"])
        stats = engine.offload.stats()
        assert stats["bytes_loaded_host"] > 0 and "bytes_loaded_disk" not in stats
        block = engine.model.moe_blocks()[0]
        assert block.w13.data_ptr() == engine.offload.cache.w13.data_ptr()
        assert block.w13.data_ptr() != engine.weights["layers.0.moe.w13"].data_ptr()
    finally:
        engine.offload.close()


@pytest.mark.parametrize("semantic", ["iteration", "prompt"])
def test_finemoe_is_given_each_iterations_semantic_embedding(semantic, tiny_model_dir):
    """"iteration": the mean of the embedding rows of the tokens the step feeds (the prompt at
    prefill, the last sampled token at decode); "prompt": the prompt's mean at every step."""
    engine = _engine(tiny_model_dir, expert_cache_fraction=0.25, offload_semantic=semantic)
    seen: list[torch.Tensor] = []
    policy = engine.offload.policy
    begin = policy.begin_iteration
    policy.begin_iteration = lambda requests: (seen.extend(r.embedding for r in requests), begin(requests))[1]
    try:
        prompt = [5, 6, 7, 8, 9, 10]
        tokens, _ = _run(engine, [prompt])
        engine.offload.drain()  # the policy's last calls may still run beside the forward
        embed = engine.model.embed.float()
        prompt_mean = embed[prompt].mean(dim=0)
        fed = [embed[t] for t in tokens["0"][:-1]]  # the last token is sampled, never fed
        want = [prompt_mean] + (fed if semantic == "iteration" else [prompt_mean] * len(fed))
        assert len(seen) == len(want) == MAX_TOKENS
        for got, expected in zip(seen, want, strict=True):
            torch.testing.assert_close(got, expected)
    finally:
        engine.offload.close()
    with pytest.raises(ValueError, match="offload_semantic"):
        _engine(tiny_model_dir, expert_cache_fraction=0.5, offload_semantic="tokens")


def test_a_cache_that_holds_every_expert_runs_no_policy(tiny_model_dir, resident):
    engine = _engine(tiny_model_dir, expert_cache_fraction=1.0, offload_policy="finemoe")
    calls: list[str] = []
    policy = engine.offload.policy
    for name in ("begin_iteration", "observe_layer", "prefetch_plan", "choose_victims", "end_iteration"):
        setattr(policy, name, lambda *a, _name=name, **k: calls.append(_name))
    try:
        copier = engine.offload.cache.copier
        assert engine.offload.cache.holds_every_expert and copier._thread is None  # no copy thread
        _assert_same(_run(engine), resident["qwen3_moe"])
        stats = engine.offload.stats()
        assert calls == [] and stats["policy_s"] == 0.0
        assert stats["on_demand_loads"] == stats["resident_experts"] > 0 and stats["evictions"] == 0  # first uses
        engine.offload.cache.check_integrity()
    finally:
        engine.offload.close()


def test_the_cache_never_exceeds_its_byte_budget(tiny_model_dir):
    cfg = ModelConfig.from_pretrained(tiny_model_dir)
    expert_bytes = 3 * cfg.hidden_size * cfg.moe_intermediate_size * 4  # gate, up, down in fp32
    budget = 5 * expert_bytes + expert_bytes // 2  # room for 5.5 experts: 5 rows
    engine = _engine(tiny_model_dir, expert_cache_bytes=budget)
    try:
        cache = engine.offload.cache
        assert cache.capacity == 5
        assert cache.w13.nbytes + cache.w2.nbytes == 5 * expert_bytes <= budget
        _run(engine)
        assert engine.offload.stats()["resident_experts"] <= 5
        cache.check_integrity()
    finally:
        engine.offload.close()


def test_a_budget_below_one_tokens_experts_is_refused_naming_the_flag(tiny_model_dir):
    with pytest.raises(ValueError, match=r"--expert-cache-gb .*at least 2"):
        _engine(tiny_model_dir, expert_cache_bytes=1000)
    with pytest.raises(ValueError, match="expert_cache_fraction"):
        _engine(tiny_model_dir, expert_cache_fraction=1.5)
    with pytest.raises(ValueError, match="offload_policy"):
        _engine(tiny_model_dir, expert_cache_fraction=0.5, offload_policy="clairvoyant")


def _errors_of_a_run(engine: LLMEngine) -> list[str]:
    """Run PROMPTS to the end: every request finishes; the errors of those that failed."""
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(f"a{i}", prompt, GREEDY)
    outs = []
    while engine.has_unfinished_requests():
        outs += engine.step()
    finished = {o.request_id: o for o in outs if o.finished}
    assert len(finished) == len(PROMPTS)
    return [o.error for o in finished.values() if o.finish_reason == "error"]


def test_an_unreadable_expert_fails_only_its_requests(tiny_model_dir, resident):
    """The disk tier raises for one expert: the requests routed to it finish with an error, the
    engine goes on, and once the tier reads again the same prompts give the resident outputs."""
    engine = _engine(tiny_model_dir, expert_cache_fraction=0.25, offload_policy="on_demand")
    # The fault goes into the forward thread's copies: the copier's own thread (half of a layer's
    # misses, where it polls) copies outside it, so the loads stay with this thread. A real read
    # error reaches both: the next test.
    engine.offload.cache._copier_shares_loads = False
    broken = fail_forward_copies(engine.offload.cache, lambda layer, local: (layer, local) == (1, 3))
    try:
        errors = _errors_of_a_run(engine)
        assert errors and all("disk read error" in e for e in errors)
        engine.offload.cache.check_integrity()
        broken["on"] = False
        _assert_same(_run(engine), resident["qwen3_moe"])
    finally:
        engine.offload.close()


def test_a_checkpoint_cut_short_under_the_engine_fails_requests_not_the_engine(tiny_model_dir, resident, tmp_path):
    """The checkpoint is copied over in place while the engine serves from its disk tier: cut to
    half, the reads past the cut (prefetches on the copy thread, loads on the forward) fail their
    requests with the reason, the engine goes on, and once the files are whole again the same
    prompts give the resident outputs. Read through a mapping, the process would have faulted."""
    model = tmp_path / "model"
    shutil.copytree(tiny_model_dir, model)
    engine = _engine(str(model), expert_cache_fraction=0.25, offload_policy="finemoe")
    whole = {path: path.read_bytes() for path in model.glob("*.safetensors")}
    try:
        for path, data in whole.items():
            os.truncate(path, len(data) // 2)
        errors = _errors_of_a_run(engine)
        assert errors and all("before this expert does" in e or "from the disk tier failed" in e for e in errors)
        engine.offload.cache.check_integrity()
        for path, data in whole.items():  # in place: the engine's open files see it
            with open(path, "r+b") as f:
                f.write(data)
        _assert_same(_run(engine), resident["qwen3_moe"])
    finally:
        engine.offload.close()


RANK_PROMPTS = {0: [[5, 6, 7, 8, 9] * 6, list(range(40, 61))], 1: [[11, 12, 13], [3, 4]]}


def _ep_worker(rank: int, world: int, port: int, model_dir: str, offload: dict, queue) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        engine = LLMEngine(EngineConfig(model=model_dir, dtype=torch.float32, ep_rank=rank, ep_size=world,
                                        num_threads=1, **offload))
        tokens, logits = _run(engine, RANK_PROMPTS[rank], dist.group.WORLD)
        stats = engine.offload.stats() if engine.offload is not None else {}
        queue.put((rank, (tokens, [t.numpy() for t in logits], stats)))  # numpy: see test_expert_parallel
    except BaseException as e:
        queue.put((rank, f"rank {rank} failed: {e!r}"))
        raise
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_ep2_with_a_quarter_of_the_experts_matches_resident_ep1(tiny_model_dir):
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    offload = {"expert_cache_fraction": 0.25, "offload_policy": "finemoe"}
    procs = [ctx.Process(target=_ep_worker, args=(r, 2, port, tiny_model_dir, offload, queue)) for r in range(2)]
    for p in procs:
        p.start()
    results = dict(queue.get(timeout=240) for _ in procs)
    for p in procs:
        p.join(timeout=60)
    failures = [r for r in results.values() if isinstance(r, str)]
    assert not failures, failures
    for rank in (0, 1):
        tokens, logits, stats = results[rank]
        want = _run(_engine(tiny_model_dir), RANK_PROMPTS[rank])
        _assert_same((tokens, [torch.from_numpy(t) for t in logits]), want)
        assert stats["on_demand_loads"] > 0 and stats["resident_experts"] <= stats["capacity_experts"]
