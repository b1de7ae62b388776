"""The trace-driven simulator: its accounting, and what prefetching buys on hand-made traces."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from offload_factories import cyclic_request, make_trace, mixed_routes

from elasticmoe.offload import POLICIES, PolicyConfig, make_policy
from elasticmoe.offload.replay import ReplayConfig, replay


def config_for(trace, prefetch_distance: int = 1) -> PolicyConfig:
    return PolicyConfig(trace.num_layers, trace.num_experts, trace.top_k, prefetch_distance, store_capacity=8)


@pytest.mark.parametrize("name", list(POLICIES))
def test_every_routed_expert_is_a_hit_or_a_miss_and_every_prefetch_used_or_wasted(name):
    routes = mixed_routes()
    trace = make_trace(routes, speculate=True)
    stats = replay(trace, make_policy(name, config_for(trace)), ReplayConfig(capacity=5, prefetch_per_layer=2,
                                                                            warmup_requests=1))
    measured = routes[1:]
    lookups = sum(len({tok[layer] for tok in it}) for request in measured for it in request for layer in range(3))
    assert stats.hits + stats.misses == lookups
    assert stats.num_iterations == sum(len(r) for r in measured) and stats.num_prefill_iterations == 3
    assert stats.prefetch_used + stats.prefetch_wasted == stats.prefetch_loads
    assert stats.prefill_hits + stats.prefill_misses <= lookups
    if name == "on_demand":
        assert stats.prefetch_loads == 0


def test_with_room_for_every_expert_only_first_uses_miss():
    routes = mixed_routes(seed=1)
    trace = make_trace(routes)
    stats = replay(trace, make_policy("on_demand", config_for(trace)), ReplayConfig(capacity=12))
    distinct = {(layer, tok[layer]) for request in routes for it in request for tok in it for layer in range(3)}
    assert stats.misses == len(distinct) and stats.evictions == 0


def test_finemoe_prefetches_a_repeated_request_that_defeats_lru():
    # two identical requests cycling through 3 experts with room for 2: one LRU order over every
    # layer always evicts the next one (per layer, shares of 1, 1 and 0 rows, some come back)
    trace = make_trace([cyclic_request(), cyclic_request()], embeddings=[[1.0, 0.0], [1.0, 0.0]])
    run = ReplayConfig(capacity=2, prefetch_per_layer=1, warmup_requests=1)
    on_demand = replay(trace, make_policy("on_demand", replace(config_for(trace), lru_per_layer=False)), run)
    finemoe = replay(trace, make_policy("finemoe", config_for(trace)), run)
    assert on_demand.hit_rate == 0.0
    assert finemoe.hit_rate == 1.0 and finemoe.prefetch_loads == 9 and finemoe.prefetch_wasted == 0


def test_lru_speculation_guesses_every_layer_but_the_first():
    trace = make_trace([cyclic_request(), cyclic_request()], speculate=True)
    stats = replay(trace, make_policy("lru", config_for(trace)), ReplayConfig(capacity=2, prefetch_per_layer=1,
                                                                             warmup_requests=1))
    assert stats.hits == 6 and stats.misses == 3  # layer 0 of each iteration has no guess


def test_a_prefetcher_with_no_bandwidth_prefetches_nothing():
    trace = make_trace([cyclic_request(), cyclic_request()], embeddings=[[1.0, 0.0], [1.0, 0.0]])
    stats = replay(trace, make_policy("finemoe", config_for(trace)), ReplayConfig(2, prefetch_per_layer=0,
                                                                                 warmup_requests=1))
    assert stats.prefetch_loads == 0 and stats.hit_rate == 0.0


def test_batches_run_iterations_of_several_requests_together():
    routes = mixed_routes(num_requests=3)
    routes[1] = routes[1][:2]  # request 1 finishes early
    trace = make_trace(routes)
    stats = replay(trace, make_policy("lfu", config_for(trace)), ReplayConfig(capacity=8, batch_size=2))
    assert stats.num_iterations == 4 + 4  # batch {0, 1}: 4 steps; batch {2}: 4 steps
    assert stats.num_prefill_iterations == 2
    with pytest.raises(ValueError, match="semantic"):
        ReplayConfig(capacity=4, semantic="tokens")


def test_a_history_runs_unmeasured_through_the_same_cache():
    """With room for every expert, a trace replayed after itself only hits; its history is not counted."""
    trace = make_trace(mixed_routes(seed=1))
    cold = replay(trace, make_policy("on_demand", config_for(trace)), ReplayConfig(capacity=12))
    warm = replay(trace, make_policy("on_demand", config_for(trace)), ReplayConfig(capacity=12), history=[trace] * 2)
    assert cold.misses > 0 and warm.misses == 0
    assert warm.hits == cold.hits + cold.misses and warm.num_iterations == cold.num_iterations
    other = make_trace([[[[0, 0]]]])  # two layers, not three
    with pytest.raises(ValueError, match="model shape"):
        replay(trace, make_policy("on_demand", config_for(trace)), ReplayConfig(capacity=12), history=[other])


def test_renumbered_experts_route_the_same_requests_to_other_experts():
    trace = make_trace(mixed_routes(seed=2), speculate=True)
    new_id = torch.tensor([2, 0, 3, 1])
    moved = trace.with_experts_renumbered(new_id)
    assert torch.equal(moved.topk_ids, new_id[trace.topk_ids])
    for old in range(4):
        assert torch.equal(moved.gate_probs[..., int(new_id[old])], trace.gate_probs[..., old])
        assert torch.equal(moved.next_gate_probs[..., int(new_id[old])], trace.next_gate_probs[..., old])
    assert torch.equal(moved.iteration_embedding, trace.iteration_embedding)
    with pytest.raises(ValueError, match="permutation"):
        trace.with_experts_renumbered(torch.tensor([0, 0, 1, 2]))
