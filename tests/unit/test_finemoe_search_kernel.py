"""FineMoE's per-layer search and plan in one kernel call (csrc/finemoe_search.cpp) equals the
NumPy reference it replaces: the same matches, plans, eviction guide and victims, over whole
iterations on random stores (requests of one token and of several: eq. 8's floor), with ties
among records and among experts, and refuses arguments it would read out of bounds. Likewise
its victim picker against `pick_victims` over `eviction_priority`."""

from __future__ import annotations

import copy
from collections.abc import Iterator

import numpy as np
import pytest
import torch

from elasticmoe.kernels import finemoe_search
from elasticmoe.offload.cache_state import CacheState
from elasticmoe.offload.finemoe import FineMoEPolicy
from elasticmoe.offload.map_store import ExpertMapStore
from elasticmoe.offload.policy import PolicyConfig, RequestContext
from elasticmoe.offload.ranking import PlanMaker, pick_victims, plan_from_predictions
from elasticmoe.offload.selection import PROB_FLOOR, eviction_priority

pytestmark = pytest.mark.skipif(not finemoe_search.available(), reason="no C++ compiler: the NumPy path runs")


def both_ways(monkeypatch: pytest.MonkeyPatch) -> Iterator[bool]:
    """Runs the loop body twice: with the kernel (True), then on the NumPy steps (False)."""
    for use_kernel in (True, False):
        with monkeypatch.context() as patch:
            if not use_kernel:
                patch.setattr(finemoe_search, "bind", lambda *args, **kwargs: None)
                patch.setattr(finemoe_search, "victim_picker", lambda *args, **kwargs: None)
                patch.setattr(finemoe_search, "store_placer", lambda *args, **kwargs: None)
                patch.setattr(finemoe_search, "semantic_best", lambda *args, **kwargs: None)
            yield use_kernel


def fill_store(policy: FineMoEPolicy, rng: np.random.Generator, records: int, alpha: float = 0.3) -> None:
    cfg = policy.config
    for _ in range(records):
        probs = rng.dirichlet(np.full(cfg.num_experts, alpha), size=cfg.num_layers).astype(np.float32)
        policy.store.insert(rng.standard_normal(6).astype(np.float32), probs)


def run_iterations(policy: FineMoEPolicy, gate_probs: list[list[torch.Tensor]], embeddings: list[torch.Tensor],
                   tokens: tuple[int, ...]) -> list[tuple]:
    """Every observable decision of each iteration: plans after its start and after each layer,
    the guide, victims.
    Request b feeds `tokens[b]` tokens (its rows of `gate_probs`, in order)."""
    cache = CacheState.empty(policy.config.num_layers, policy.config.num_experts, 12).load(
        [(layer, e) for layer in range(policy.config.num_layers) for e in range(0, policy.config.num_experts, 3)][:12])
    seen = []
    for layers in gate_probs:
        contexts = [RequestContext(f"r{b}", n, emb, is_prefill=n > 1)
                    for b, (emb, n) in enumerate(zip(embeddings, tokens, strict=True))]
        policy.begin_iteration(contexts)
        plan = policy.prefetch_plan(cache)  # the first d layers, from the semantic search's matches
        seen.append((-1, [(i.layer, i.expert, round(i.priority, 6)) for i in plan.items], policy._guide.copy(),
                     policy.choose_victims(cache, 3, set())))
        for layer, probs in enumerate(layers):
            policy.observe_layer(layer, probs, torch.topk(probs, policy.config.top_k).indices)
            plan = policy.prefetch_plan(cache)
            seen.append((layer, [(i.layer, i.expert, round(i.priority, 6)) for i in plan.items],
                         policy._guide.copy(), policy.choose_victims(cache, 3, set())))
        policy.end_iteration([])
    return seen


@pytest.mark.parametrize(("tokens", "distance", "records"),
                         [((1,), 1, 50), ((1, 1, 1), 1, 200), ((1, 1), 2, 30), ((1,), 3, 1), ((6,), 1, 50),
                          ((3, 1, 20), 1, 200), ((2, 9), 2, 30), ((1, 1, 1), 1, 400), ((3, 1, 20), 2, 400)])
def test_the_kernel_decides_as_the_numpy_steps(monkeypatch, tokens, distance, records):
    """Whole iterations; with 400 records the store is full and each iteration's maps replace records."""
    cfg = PolicyConfig(num_layers=5, num_experts=8, top_k=2, prefetch_distance=distance, store_capacity=400)
    batch = len(tokens)
    rng = np.random.default_rng(sum(tokens) * 10 + distance)
    gate = [[torch.from_numpy(rng.dirichlet(np.full(8, 0.4), size=sum(tokens)).astype(np.float32))
             for _ in range(5)] for _ in range(4)]
    embeddings = [torch.from_numpy(rng.standard_normal(6).astype(np.float32)) for _ in range(batch)]
    results = []
    for _ in both_ways(monkeypatch):
        policy = FineMoEPolicy(cfg)
        fill_store(policy, np.random.default_rng(7), records)
        results.append((run_iterations(policy, gate, embeddings, tokens), policy.search_log.trajectory,
                        policy.store._last_matched.copy()))
    (kernel, kernel_scores, kernel_marks), (reference, reference_scores, reference_marks) = results
    assert np.array_equal(kernel_marks, reference_marks)  # the same maps marked as in use
    assert len(kernel) == len(reference) and kernel_scores  # searches did run
    for (layer, plan, guide, victims), (want_layer, want_plan, want_guide, want_victims) in zip(kernel, reference, strict=True):
        assert (layer, plan, victims) == (want_layer, want_plan, want_victims)
        assert np.array_equal(guide, want_guide)
    assert np.allclose(kernel_scores, reference_scores, atol=1e-6)


def test_equal_records_go_to_the_latest_and_equal_probabilities_to_the_lower_expert(monkeypatch):
    """Three copies of one map (equal scores: the latest wins, as in the store) whose layer 1 ties
    experts 1, 2 and 3 (the set takes the lower ids first)."""
    cfg = PolicyConfig(num_layers=2, num_experts=4, top_k=2, prefetch_distance=1, store_capacity=8)
    tied = np.array([[0.7, 0.1, 0.1, 0.1], [0.1, 0.3, 0.3, 0.3]], dtype=np.float32)
    plans = []
    for _ in both_ways(monkeypatch):
        policy = FineMoEPolicy(cfg)
        for _ in range(3):
            policy.store.insert(np.ones(6, dtype=np.float32), tied)
        policy.begin_iteration([RequestContext("r", 1, torch.ones(6), is_prefill=False)])
        policy.observe_layer(0, torch.from_numpy(tied[None, 0]), torch.tensor([[0, 1]]))
        plans.append(([(i.layer, i.expert) for i in policy.prefetch_plan(CacheState.empty(2, 4, 4)).items],
                      policy.search_log.trajectory))
    assert plans[0] == plans[1]
    assert plans[0][0] == [(1, 1), (1, 2)]  # score 1: threshold 0, so the top-k, ties in id order
    assert plans[0][1] == pytest.approx([1.0])


def test_the_kernel_refuses_a_layer_or_record_out_of_range_and_a_wrong_layout():
    arrays = dict(maps=np.zeros((2, 4, 3), dtype=np.float32)[:, :1],
                  columns=np.zeros((2, 3, 4), dtype=np.float32)[:, :, :1], norms=np.ones((2, 1), dtype=np.float32),
                  stamps=np.zeros(1, dtype=np.int64), observed=np.zeros((1, 2, 3), dtype=np.float32),
                  dots=np.zeros((1, 1), dtype=np.float32), new_sq=np.zeros(1, dtype=np.float32),
                  planned=np.zeros((2, 3), dtype=np.bool_), planned_probs=np.zeros((2, 3)), guide=np.zeros((2, 3)),
                  num_tokens=np.ones(1, dtype=np.int32))
    step = finemoe_search.bind(**arrays, top_k=1)
    with pytest.raises(ValueError, match="out of range"):
        step(1, 2)  # the target past the last layer
    with pytest.raises(ValueError, match="out of range"):
        step(1, 1)  # a target that is not ahead
    with pytest.raises(ValueError, match="out of range"):
        step(2, None)  # a layer the model does not have
    index, score = step(0, 1)
    assert index.tolist() == [0] and score.tolist() == [0.0]  # zero vectors: cosine 0, not NaN
    with pytest.raises(ValueError, match="out of range"):
        step.plan(2, [0], [1.0])  # a semantic plan past the last layer
    with pytest.raises(ValueError, match="out of range"):
        step.plan(0, [1], [1.0])  # a record the store does not have (C = 1)
    arrays["planned"][:] = False  # step(0, 1) planned all of layer 1 (score 0: the whole mass)
    step.plan(1, [0], [1.0])
    assert arrays["planned"][1].tolist() == [True, False, False]  # score 1: the top-1, ties to the lowest id
    with pytest.raises(ValueError, match="planned_probs must be contiguous float64"):
        finemoe_search.bind(**{**arrays, "planned_probs": np.zeros((2, 3), np.float32)}, top_k=1)
    with pytest.raises(ValueError, match="columns must be"):
        finemoe_search.bind(**{**arrays, "columns": np.zeros((2, 1, 3), np.float32)}, top_k=1)  # [L, C, E]
    with pytest.raises(ValueError, match="dots must be"):
        finemoe_search.bind(**{**arrays, "dots": np.zeros((1, 2), np.float32)}, top_k=1)  # C = 1 record
    with pytest.raises(ValueError, match="num_tokens must be"):
        finemoe_search.bind(**{**arrays, "num_tokens": np.ones(1, np.int64)}, top_k=1)
    with pytest.raises(ValueError, match="every request has >= 1 token"):
        finemoe_search.bind(**{**arrays, "num_tokens": np.zeros(1, np.int32)}, top_k=1)


@pytest.mark.parametrize("seed", range(6))
def test_the_victim_picker_evicts_as_the_numpy_ranking(seed):
    """Random caches where priorities tie (guide values and visit counts from small sets, guide 0
    under the floor) and stamps tie (experts loaded together), any number of victims, protected
    experts resident or not."""
    rng = np.random.default_rng(seed)
    shape = (4, 6)
    guide = np.zeros(shape)
    picker = finemoe_search.victim_picker(guide, PROB_FLOOR)
    for _ in range(40):
        guide[:] = rng.choice([0.0, 1e-7, 0.1, 0.25, 0.5], size=shape)
        resident = rng.random(shape) < 0.6
        cache = CacheState(int(resident.sum()) + 1, resident, rng.integers(-1, 4, size=shape),
                           rng.integers(0, 3, size=shape), clock=5)
        protected = {(int(layer), int(e)) for layer, e in zip(rng.integers(0, 4, 3), rng.integers(0, 6, 3), strict=True)}
        for num_victims in (0, 1, 2, 5, cache.num_resident + 2):
            want = pick_victims(cache, eviction_priority(guide, cache.num_uses), num_victims, protected)
            got = picker.pick(cache.resident, cache.last_used, cache.num_uses, num_victims, protected)
            assert got == want
    assert not picker._protected.any()  # the marks are cleared after every call


def test_the_victim_picker_refuses_arrays_of_another_shape_or_dtype():
    picker = finemoe_search.victim_picker(np.zeros((2, 3)), PROB_FLOOR)
    resident, stamps = np.ones((2, 3), dtype=np.bool_), np.zeros((2, 3), dtype=np.int64)
    assert picker.pick(resident, stamps, stamps, 2, {(0, 0)}) == [(0, 1), (0, 2)]
    with pytest.raises(ValueError, match="need contiguous int64"):
        picker.pick(resident, stamps.astype(np.int32), stamps, 1, ())
    with pytest.raises(ValueError, match=r"need contiguous bool \(2, 3\)"):
        picker.pick(np.ones((3, 2), dtype=np.bool_), stamps, stamps, 1, ())
    with pytest.raises(ValueError, match="guide must be contiguous float64"):
        finemoe_search.victim_picker(np.zeros((2, 3), dtype=np.float32), PROB_FLOOR)


@pytest.mark.parametrize("seed", range(8))
def test_the_placement_kernel_fills_a_full_store_as_the_numpy_loop(seed):
    """Batches of 1-6 new records into a store that fills on the way (the first batches append, then
    replace), with a record repeated inside a batch (it replaces its twin), records matched now
    and then (the others grow stale), and RDY from the store's own pass or from the iteration's
    searches: the same slots, store arrays and counters both ways."""
    rng = np.random.default_rng(seed)
    num_layers, num_experts, hidden = 4, 8, 6
    kernel = ExpertMapStore(24, num_layers, num_experts, prefetch_distance=1 + seed % 2)
    numpy_only = copy.deepcopy(kernel)
    numpy_only._bound_placer = False  # as where the kernels do not build
    for iteration in range(60):
        batch = int(rng.integers(1, 7))
        embeddings = rng.standard_normal((batch, hidden)).astype(np.float32)
        maps = rng.dirichlet(np.full(num_experts, 0.3), size=(batch, num_layers)).astype(np.float32)
        if batch > 2:
            embeddings[2], maps[2] = embeddings[0], maps[0]
        if iteration % 4 == 0 and len(kernel):
            for store in (kernel, numpy_only):
                store.mark_matched(np.array([iteration % len(store)]))
        if iteration % 2 and len(kernel) == kernel.capacity:  # RDY from the iteration's own searches
            slots = []
            for store in (kernel, numpy_only):
                search = store.trajectory_search(batch)
                for layer in range(num_layers):
                    search.add(maps[:, layer])
                slots.append(store.insert_many(embeddings, maps, search.searched(store.semantic_scores(embeddings))))
            assert slots[0] == slots[1]
            continue
        assert kernel.insert_many(embeddings, maps) == numpy_only.insert_many(embeddings, maps)
    assert kernel._bound_placer, "the kernel placed the records"
    for name in ("_embeddings", "_embedding_norms", "_maps", "_columns", "_trajectory_norms"):
        np.testing.assert_allclose(getattr(kernel, name), getattr(numpy_only, name), rtol=1e-6, atol=1e-7)
    for name in ("_stamps", "_last_matched", "_num_added", "num_replaced", "_size"):
        np.testing.assert_array_equal(getattr(kernel, name), getattr(numpy_only, name))
    assert kernel.num_replaced > 100


def test_the_observation_copies_a_decode_steps_rows_and_marks_its_matches():
    """`KernelPlanner.observe` with the layer's gate rows: they land in `observed`, the matches are
    stamped in the store's `last_matched`; rows of another layout are refused, nothing written."""
    store = ExpertMapStore(3, 2, 4, prefetch_distance=1)
    for e in range(3):
        store.insert(np.eye(3, dtype=np.float32)[e], np.tile(np.eye(4, dtype=np.float32)[e], (2, 1)))
    observed = np.zeros((2, 2, 4), dtype=np.float32)
    planned, probs = np.zeros((2, 4), dtype=np.bool_), np.zeros((2, 4))
    planner = store.trajectory_search(2).planner(observed, 1, np.ones(2, dtype=np.int32), planned, probs,
                                                 np.zeros((2, 4)))
    rows = torch.tensor([[0.0, 0.9, 0.1, 0.0], [0.0, 0.0, 0.2, 0.8]])
    for bad in (rows.double(), rows.T.contiguous().T, rows[:1]):
        with pytest.raises(ValueError, match="probs must be contiguous float32"):
            planner.observe(1, bad)
    assert not observed.any() and planner.search.num_layers == 0
    store._last_matched[:] = -1
    index, _ = planner.observe(1, rows)
    np.testing.assert_array_equal(observed[:, 0], rows.numpy())
    assert index.tolist() == [1, 2]  # routed like the second and the third record
    assert store._last_matched.tolist() == [-1, 3, 3]  # stamped with the records added so far


@pytest.mark.parametrize("batch", [1, 5])
def test_the_semantic_search_matches_and_marks_as_numpy(monkeypatch, batch):
    """Eq. 4's scores, best matches (one embedding stored three times, matched by a query along it;
    a zero query scores 0 everywhere) and the marks of the matched records, with and without the
    kernel. (Which of the three wins depends on BLAS's rounding of equal rows; both ways agree.)"""
    results = []
    for use_kernel in both_ways(monkeypatch):
        store = ExpertMapStore(12, 2, 3, prefetch_distance=1)
        twin = np.random.default_rng(batch).standard_normal(7).astype(np.float32)
        for i in range(10):
            embedding = twin if i in (2, 5, 8) else np.random.default_rng(i).standard_normal(7).astype(np.float32)
            store.insert(embedding, np.full((2, 3), 1 / 3, dtype=np.float32))
        queries = np.random.default_rng(99).standard_normal((batch, 7)).astype(np.float32)
        queries[0] = 2 * twin
        if batch > 1:
            queries[1] = 0.0
        store._last_matched[:] = -1
        results.append((*store.match_semantic(queries), store._last_matched.copy(), use_kernel))
    (scores, index, best, marks, _), (want_scores, want_index, want_best, want_marks, _) = results
    np.testing.assert_allclose(scores, want_scores, rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(best, want_best, rtol=1e-6, atol=1e-7)
    assert index.tolist() == want_index.tolist() and index[0] in (2, 5, 8) and best[0] == pytest.approx(1.0)
    np.testing.assert_array_equal(marks, want_marks)
    assert marks[index[0]] == 10 and (marks >= 0).sum() == len(set(index.tolist()))


def test_the_placement_kernel_refuses_arrays_of_another_shape_or_dtype():
    store = ExpertMapStore(4, 2, 3, prefetch_distance=1)
    for _ in range(4):
        store.insert(np.ones(5, dtype=np.float32), np.full((2, 3), 1 / 3, dtype=np.float32))
    placer = store._placer()
    new = {"embeddings": np.ones((1, 5), np.float32), "maps": np.ones((1, 6), np.float32)}
    redundancy = np.zeros((1, 4), np.float32)
    assert placer.place(**new, redundancy=redundancy, searched=None, w_sem=0.5, num_added=4) == ([3], 5)  # ties: latest
    searched = [np.zeros((1, 4), np.float32), np.zeros((1, 4), np.float32), np.ones(1, np.float32),
                np.ones(4, np.float32)]
    # RDY 0 everywhere again, but record 0 is now older than the store's capacity: the stalest goes
    assert placer.place(**new, redundancy=None, searched=searched, w_sem=0.5, num_added=5) == ([0], 6)
    for name, bad in (("maps", np.ones((1, 5), np.float32)), ("embeddings", np.ones((1, 5), np.float32)[:, ::-1])):
        with pytest.raises(ValueError, match=f"{name} must be contiguous float32"):
            placer.place(**{**new, name: bad}, redundancy=redundancy, searched=None, w_sem=0.5, num_added=4)
    with pytest.raises(ValueError, match="redundancy must be contiguous float32"):
        placer.place(**new, redundancy=redundancy.astype(np.float64), searched=None, w_sem=0.5, num_added=4)
    with pytest.raises(ValueError, match="trajectory_sq must be contiguous float32"):
        placer.place(**new, redundancy=None, searched=[*searched[:2], np.ones(2, np.float32), searched[3]], w_sem=0.5,
                     num_added=4)
    with pytest.raises(ValueError, match="needs the redundancy or the searches"):
        placer.place(**new, redundancy=None, searched=None, w_sem=0.5, num_added=4)
    with pytest.raises(ValueError, match="stamps must be contiguous int64"):
        finemoe_search.store_placer(store._embeddings, store._embedding_norms, store._maps, store._columns,
                                    store._trajectory_norms, store._stamps.astype(np.int32), store._last_matched)


@pytest.mark.parametrize("seed", range(6))
def test_the_plan_kernel_plans_as_the_numpy_ranking(seed):
    """Random predictions with tied priorities (probabilities from a small set, across layers too:
    0.5 at distance 2 ties 0.25 at distance 1), every current layer, residency arrays replaced
    between calls (the ranker binds each new one) and changed in place never (snapshots)."""
    rng = np.random.default_rng(seed)
    shape = (5, 6)
    planned, probs = np.zeros(shape, dtype=np.bool_), np.zeros(shape)
    maker = PlanMaker(planned, probs)
    assert maker._ranker is not None
    for _ in range(30):
        planned[:] = rng.random(shape) < 0.5
        probs[:] = rng.choice([0.0, 0.125, 0.25, 0.5, 1.0], size=shape)
        resident = rng.random(shape) < 0.4
        cache = CacheState(int(resident.sum()) + 1, resident, np.full(shape, -1), np.zeros(shape, dtype=np.int64))
        for current in range(-1, shape[0]):
            assert maker.plan(current, cache) == plan_from_predictions(planned, probs, current, cache)
    nothing = CacheState(shape[0] * shape[1], np.ones(shape, dtype=np.bool_), np.full(shape, -1),
                         np.zeros(shape, dtype=np.int64))
    assert maker.plan(2, nothing) is maker.plan(2, nothing)  # the empty plan after a layer is made once
    assert maker.plan(2, nothing) == plan_from_predictions(planned, probs, 2, nothing)


def test_the_plan_kernel_refuses_a_layer_or_arrays_it_would_misread():
    planned, probs = np.ones((2, 3), dtype=np.bool_), np.zeros((2, 3))
    ranker = finemoe_search.plan_ranker(planned, probs)
    resident = np.zeros((2, 3), dtype=np.bool_)
    assert ranker.rank(resident, 0) == ([3, 4, 5], [0.0, 0.0, 0.0])
    for layer in (-2, 2):
        with pytest.raises(ValueError, match=f"current layer {layer} out of range"):
            ranker.rank(resident, layer)
    with pytest.raises(ValueError, match=r"resident must be contiguous bool \(2, 3\)"):
        ranker.rank(np.zeros((3, 2), dtype=np.bool_), 0)
    with pytest.raises(ValueError, match="resident must be contiguous bool"):
        ranker.rank(np.zeros((2, 3), dtype=np.uint8), 0)
    with pytest.raises(ValueError, match="probs must be contiguous float64"):
        finemoe_search.plan_ranker(planned, probs.astype(np.float32))
