"""The four policies behind one interface, driven as an engine drives them, on hand-made routing."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from elasticmoe.offload import POLICIES, CacheState, PolicyConfig, RequestContext, make_policy
from elasticmoe.offload.finemoe import FineMoEPolicy, SearchLog
from elasticmoe.offload.lfu import LFUPolicy, count_activations
from elasticmoe.offload.lru import LRUPolicy, OnDemandPolicy, speculative_guess
from elasticmoe.offload.ranking import layer_shares
from elasticmoe.offload.routing_map import RoutingMapRecord


def make_config(**kw) -> PolicyConfig:
    return PolicyConfig(**{"num_layers": 3, "num_experts": 4, "top_k": 1, "prefetch_distance": 1, **kw})


def make_requests(*embeddings: list[float], num_tokens: int = 1) -> list[RequestContext]:
    return [RequestContext(f"r{i}", num_tokens, torch.tensor(e)) for i, e in enumerate(embeddings)]


def one_hot(experts: list[int], num_experts: int = 4) -> torch.Tensor:
    """Gate output [T, E] sending token t to `experts[t]` with probability 1."""
    return torch.nn.functional.one_hot(torch.tensor(experts), num_experts).float()


def plan_keys(policy, cache: CacheState) -> list[tuple[int, int]]:
    return [item.key for item in policy.prefetch_plan(cache).items]


def empty_cache(capacity: int = 12) -> CacheState:
    return CacheState.empty(3, 4, capacity)


# ---- FineMoE ---------------------------------------------------------------------------


def test_finemoe_semantic_search_plans_the_first_d_layers():
    policy = FineMoEPolicy(make_config(prefetch_distance=2))
    policy.store.add(RoutingMapRecord(torch.tensor([1.0, 0.0]), one_hot([0, 1, 2])))
    policy.store.add(RoutingMapRecord(torch.tensor([0.0, 1.0]), one_hot([3, 3, 3])))
    policy.begin_iteration(make_requests([1.0, 0.1]))  # close to the first record
    plan = policy.prefetch_plan(empty_cache())
    assert plan.after_layer == -1
    assert [(i.key, i.priority) for i in plan.items] == [((0, 0), 1.0), ((1, 1), 0.5)]  # p / (l - l_now)
    assert plan_keys(policy, empty_cache().load([(0, 0)])) == [(1, 1)]  # resident experts are left out


def test_finemoe_trajectory_search_plans_layer_l_plus_d_after_layer_l():
    policy = FineMoEPolicy(make_config(prefetch_distance=1))
    policy.store.add(RoutingMapRecord(torch.tensor([1.0, 0.0]), one_hot([0, 1, 2])))
    policy.store.add(RoutingMapRecord(torch.tensor([0.0, 1.0]), one_hot([3, 3, 3])))
    policy.begin_iteration(make_requests([1.0, 0.0]))  # semantically the first record...
    assert plan_keys(policy, empty_cache()) == [(0, 0)]
    policy.observe_layer(0, one_hot([3]), torch.tensor([[3]]))  # ...but it routes like the second
    assert plan_keys(policy, empty_cache()) == [(1, 3)]
    policy.observe_layer(1, one_hot([3]), torch.tensor([[3]]))
    assert plan_keys(policy, empty_cache()) == [(2, 3)]
    assert policy.search_log.summary()["num_trajectory_searches"] == 2
    with pytest.raises(ValueError, match="expected layer 2"):
        policy.observe_layer(0, one_hot([3]), torch.tensor([[3]]))


def test_finemoe_marks_the_maps_its_plans_come_from_as_in_use():
    """Each search whose match plans a layer keeps that stored map from going stale."""
    policy = FineMoEPolicy(make_config(prefetch_distance=1))
    policy.store.add(RoutingMapRecord(torch.tensor([1.0, 0.0]), one_hot([0, 1, 2])))
    policy.store.add(RoutingMapRecord(torch.tensor([0.0, 1.0]), one_hot([3, 3, 3])))
    stamps = policy.store._last_matched  # when each record was stored or last matched, in records added
    assert stamps[:2].tolist() == [0, 1] and len(policy.store) == 2
    policy.begin_iteration(make_requests([1.0, 0.0]))  # the semantic match: record 0
    assert stamps[:2].tolist() == [2, 1]
    policy.observe_layer(0, one_hot([3]), torch.tensor([[3]]))  # the trajectory: record 1, planning layer 1
    assert stamps[:2].tolist() == [2, 2]
    stamps[:2] = -1
    policy.observe_layer(1, one_hot([3]), torch.tensor([[3]]))  # record 1 again, planning layer 2
    assert stamps[:2].tolist() == [-1, 2]
    stamps[:2] = -1
    policy.observe_layer(2, one_hot([3]), torch.tensor([[3]]))  # the last layer plans nothing: no mark
    assert stamps[:2].tolist() == [-1, -1]


def test_finemoe_prefetches_more_experts_when_the_match_is_weak():
    soft = torch.tensor([[0.5, 0.3, 0.2, 0.0]] * 3)
    policy = FineMoEPolicy(make_config())
    policy.store.add(RoutingMapRecord(torch.tensor([1.0, 0.0]), soft))
    policy.begin_iteration(make_requests([1.0, 1.0]))  # score 0.71: delta 0.29, expert 0 covers it
    assert plan_keys(policy, empty_cache()) == [(0, 0)]
    policy.begin_iteration(make_requests([0.2, 1.0]))  # score 0.20: delta 0.80 needs 0.5 + 0.3 + 0.2
    assert plan_keys(policy, empty_cache()) == [(0, 0), (0, 1), (0, 2)]


def test_finemoe_plans_a_prefill_for_the_union_of_its_tokens_experts():
    """A perfect match (delta 0) plans K = 1 expert for one token; a prefill of 4 tokens whose map
    spreads [0.5, 0.3, 0.2, 0] expects 0.94 + 0.76 + 0.59 = 2.29 experts: it plans 3 (in both the
    semantic plan of layer 0 and the trajectory plan of layer 1)."""
    soft = torch.tensor([[0.5, 0.3, 0.2, 0.0]] * 3)
    for num_tokens, want in ((1, [0]), (4, [0, 1, 2])):
        policy = FineMoEPolicy(make_config())
        policy.store.add(RoutingMapRecord(torch.tensor([1.0, 0.0]), soft))
        policy.begin_iteration(make_requests([1.0, 0.0], num_tokens=num_tokens))
        assert plan_keys(policy, empty_cache()) == [(0, e) for e in want]
        policy.observe_layer(0, soft[:1].expand(num_tokens, 4), torch.zeros(num_tokens, 1, dtype=torch.long))
        assert plan_keys(policy, empty_cache()) == [(1, e) for e in want]


def test_finemoe_evicts_by_one_over_p_times_freq_and_spares_the_protected():
    policy = FineMoEPolicy(make_config())
    policy.store.add(RoutingMapRecord(torch.tensor([1.0]), torch.tensor([[0.6, 0.3, 0.1, 0.0]] * 3)))
    policy.begin_iteration(make_requests([1.0]))
    cache = empty_cache().load([(0, 0), (0, 1), (0, 2), (1, 0)])
    cache = cache.use(0, [0, 1, 2]).use(0, [1])  # visits: (0,0) 1, (0,1) 2, (0,2) 1, (1,0) 0
    # 1/(p * (visits + 1)): (0,2) 5.0, (1,0) 1.67, (0,1) 1.11, (0,0) 0.83
    assert policy.choose_victims(cache, 4, ()) == [(0, 2), (1, 0), (0, 1), (0, 0)]
    assert policy.choose_victims(cache, 2, {(0, 2)}) == [(1, 0), (0, 1)]


def test_finemoe_stores_each_complete_iteration_per_request():
    policy = FineMoEPolicy(make_config())
    requests = make_requests([1.0, 0.0], [0.0, 1.0], num_tokens=2)
    policy.begin_iteration(requests)
    for layer in range(3):  # request r0's tokens go to expert 0 and 1, r1's to 2 and 3
        policy.observe_layer(layer, one_hot([0, 1, 2, 3]), torch.tensor([[0], [1], [2], [3]]))
    policy.end_iteration()
    assert len(policy.store) == 2
    assert policy.store.maps[0, 0].tolist() == [0.5, 0.5, 0.0, 0.0]
    assert policy.store.maps[1, 2].tolist() == [0.0, 0.0, 0.5, 0.5]
    policy.begin_iteration(make_requests([1.0, 0.0]))
    policy.observe_layer(0, one_hot([0]), torch.tensor([[0]]))
    policy.end_iteration(["r0"])  # cut short: no map to keep
    assert len(policy.store) == 2


@pytest.mark.parametrize("batches", [(1, 1, 1, 2, 2, 1), (3, 3, 1, 3)])
def test_finemoe_on_a_full_store_decides_and_stores_as_with_fresh_searches(monkeypatch, batches):
    """A full store's iterations restart the last search in place and store their maps by the RDY of
    their own searches' scores; without either (a new search each time, the store's own RDY pass)
    the plans, victims, replaced slots and stored maps are the same, batch sizes changing or not."""
    from elasticmoe.offload import map_store

    cfg = make_config(num_layers=4, num_experts=6, top_k=2, store_capacity=40)
    outcomes = []
    for shortcuts in (True, False):
        rng = np.random.default_rng(11)
        with monkeypatch.context() as patch:
            if not shortcuts:
                patch.setattr(map_store.TrajectorySearch, "restart", lambda self, batch: False)
                patch.setattr(FineMoEPolicy, "_searched_scores", lambda self: None)
            policy = FineMoEPolicy(cfg)
            for _ in range(cfg.store_capacity):  # full from the start
                policy.store.insert(rng.standard_normal(5).astype(np.float32),
                                    rng.dirichlet(np.full(6, 0.3), size=4).astype(np.float32))
            cache = CacheState.empty(4, 6, 8)
            seen = []
            for batch in batches:
                requests = [RequestContext(f"r{b}", 1, torch.from_numpy(rng.standard_normal(5).astype(np.float32)))
                            for b in range(batch)]
                policy.begin_iteration(requests)
                for layer in range(4):
                    probs = torch.from_numpy(rng.dirichlet(np.full(6, 0.3), size=batch).astype(np.float32))
                    policy.observe_layer(layer, probs, torch.topk(probs, 2).indices)
                    seen.append((plan_keys(policy, cache), policy.choose_victims(cache.load([(3, 0), (3, 1)]), 1, ())))
                policy.end_iteration()
            outcomes.append((seen, policy.store.maps, policy.store.num_replaced))
    (seen, maps, replaced), (want_seen, want_maps, want_replaced) = outcomes
    assert seen == want_seen and replaced == want_replaced == sum(batches)
    assert torch.equal(maps, want_maps)


# ---- baselines ---------------------------------------------------------------------------


def test_lru_speculates_on_the_next_layer_only():
    policy = LRUPolicy(make_config(top_k=2, prefetch_distance=2))
    assert policy.needs_next_layer_gate
    policy.begin_iteration(make_requests([1.0]))
    assert plan_keys(policy, empty_cache()) == []
    next_gate = torch.tensor([[0.1, 0.6, 0.2, 0.1]])
    policy.observe_layer(0, one_hot([0]), torch.tensor([[0, 1]]), next_gate)
    plan = policy.prefetch_plan(empty_cache())
    assert [(i.key, i.priority) for i in plan.items] == [((1, 1), pytest.approx(0.6)), ((1, 2), pytest.approx(0.2))]
    assert speculative_guess(torch.tensor([[0.5, 0.4, 0.1, 0.0], [0.1, 0.2, 0.7, 0.0]]), 1) == pytest.approx({0: 0.5, 2: 0.7})


def test_lru_without_the_next_gate_guesses_last_iterations_experts():
    policy = LRUPolicy(make_config())
    policy.begin_iteration(make_requests([1.0]))
    for layer, expert in enumerate([0, 2, 3]):
        policy.observe_layer(layer, one_hot([expert]), torch.tensor([[expert]]))
    policy.end_iteration()
    policy.begin_iteration(make_requests([1.0]))
    policy.observe_layer(0, one_hot([1]), torch.tensor([[1]]))
    assert plan_keys(policy, empty_cache()) == [(1, 2)]


def test_lru_and_on_demand_evict_the_least_recently_used():
    cache = empty_cache().load([(0, 0)]).load([(1, 1)]).load([(2, 2)]).use(0, [0])
    for policy in (LRUPolicy(make_config()), OnDemandPolicy(make_config())):
        assert policy.choose_victims(cache, 3, ()) == [(1, 1), (2, 2), (0, 0)]
        assert policy.choose_victims(cache, 3, {(1, 1)}) == [(2, 2), (0, 0)]


def test_lru_and_on_demand_evict_within_each_layers_share():
    """Shares of 6 rows over 3 layers: 2 each. Layer 0 holds 3, layer 1 holds 2, layer 2 holds 1
    (stamps: (1, 0) oldest, then (0, 0), (0, 1), (1, 1), (2, 0), (0, 2))."""
    cache = empty_cache(6)
    for key in [(1, 0), (0, 0), (0, 1), (1, 1), (2, 0), (0, 2)]:
        cache = cache.load([key])
    for policy in (LRUPolicy(make_config()), OnDemandPolicy(make_config())):
        # layer 1 holds its share: its own oldest goes, though layer 0 holds more
        assert policy.choose_victims(cache, 1, (), for_layers=[1]) == [(1, 0)]
        # layer 2 is below its share: the oldest of the layers above theirs (layer 0) goes
        assert policy.choose_victims(cache, 1, (), for_layers=[2]) == [(0, 0)]
        # two rows for layer 2: after the first, layer 0 and layer 2 both hold their shares, so
        # layer 2's own goes next
        assert policy.choose_victims(cache, 2, (), for_layers=[2, 2]) == [(0, 0), (2, 0)]
        # layer 1 at its share with both of its experts protected: it borrows, first from a layer
        # above its share, the oldest there
        assert policy.choose_victims(cache, 1, {(1, 0), (1, 1)}, for_layers=[1]) == [(0, 0)]
        # nothing left anywhere but one expert
        rest = {(0, 0), (0, 1), (0, 2), (1, 0), (1, 1)}
        assert policy.choose_victims(cache, 2, rest, for_layers=[1, 1]) == [(2, 0)]
    global_lru = OnDemandPolicy(make_config(lru_per_layer=False))
    assert global_lru.choose_victims(cache, 1, (), for_layers=[2]) == [(1, 0)]  # one order over every layer


def test_layer_shares_split_the_capacity():
    assert layer_shares(8, 3) == [3, 3, 2] and layer_shares(2, 3) == [1, 1, 0] and sum(layer_shares(64, 8)) == 64


def test_on_demand_never_prefetches():
    policy = OnDemandPolicy(make_config())
    policy.begin_iteration(make_requests([1.0]))
    policy.observe_layer(0, one_hot([0]), torch.tensor([[0]]))
    plan = policy.prefetch_plan(empty_cache())
    assert plan.items == () and plan.after_layer == 0


def test_lfu_counts_tokens_per_request_and_predicts_from_finished_requests():
    assert count_activations(torch.tensor([[0, 1], [1, 3]]), 4).tolist() == [1.0, 2.0, 0.0, 1.0]
    policy = LFUPolicy(make_config())
    policy.begin_iteration(make_requests([1.0], num_tokens=2))
    assert plan_keys(policy, empty_cache()) == []  # no history yet
    for layer, experts in enumerate(([2, 2], [1, 3], [0, 0])):
        policy.observe_layer(layer, one_hot(experts), torch.tensor([[e] for e in experts]))
    policy.end_iteration(["r0"])
    assert len(policy.collection) == 1
    assert policy.collection.matrices[0].tolist() == [[0, 0, 2, 0], [0, 1, 0, 1], [2, 0, 0, 0]]
    # a new request has no activations: the collection's most popular experts guide layer 0
    policy.begin_iteration([RequestContext("r1", 1, torch.tensor([1.0]))])
    assert plan_keys(policy, empty_cache()) == [(0, 2)]
    policy.observe_layer(0, one_hot([2]), torch.tensor([[2]]))
    assert plan_keys(policy, empty_cache()) == [(1, 1)]  # top-1 of the matched matrix's layer 1 (tie: id 1)


def test_lfu_evicts_the_least_visited_then_the_least_recent():
    cache = empty_cache().load([(0, 0), (0, 1), (0, 2)]).use(0, [0, 1]).use(0, [1])
    assert LFUPolicy(make_config()).choose_victims(cache, 3, ()) == [(0, 2), (0, 0), (0, 1)]


# ---- the registry ---------------------------------------------------------------------


def test_make_policy_by_name_and_the_interface_they_share():
    assert set(POLICIES) == {"finemoe", "lru", "lfu", "on_demand"}
    for name in POLICIES:
        policy = make_policy(name, make_config())
        assert policy.name == name
        policy.begin_iteration(make_requests([1.0]))
        for layer in range(3):
            policy.observe_layer(layer, one_hot([layer]), torch.tensor([[layer]]), torch.full((1, 4), 0.25))
            assert policy.prefetch_plan(empty_cache()).after_layer == layer
        assert policy.choose_victims(empty_cache().load([(0, 0)]), 1, {(0, 0)}) == []
        policy.end_iteration(["r0"])
    with pytest.raises(ValueError, match="'belady'"):
        make_policy("belady", make_config())


def test_config_and_context_validation():
    with pytest.raises(ValueError, match="prefetch_distance"):
        make_config(prefetch_distance=4)
    with pytest.raises(ValueError, match="top_k"):
        make_config(top_k=5)
    with pytest.raises(ValueError, match="num_tokens"):
        RequestContext("r", 0, torch.ones(2))
    with pytest.raises(ValueError, match="embedding"):
        RequestContext("r", 1, torch.ones(2, 2))


def test_the_search_log_keeps_its_means_over_every_search_and_only_the_latest_scores():
    # A server searches per layer and request for days: the log must not grow with them.
    log = SearchLog(keep=5)
    for i in range(1000):
        log.add_trajectory(np.array([i % 2, 1.0], dtype=np.float32))
    log.add_semantic(np.array([0.25], dtype=np.float32))
    assert list(log.trajectory) == [1.0, 0.0, 1.0, 1.0, 1.0] and list(log.semantic) == [0.25]
    summary = log.summary()
    assert summary["num_trajectory_searches"] == 2000 and summary["mean_trajectory_score"] == pytest.approx(0.75)
    assert summary["num_semantic_searches"] == 1 and summary["mean_semantic_score"] == pytest.approx(0.25)
    assert SearchLog().summary()["mean_trajectory_score"] is None
