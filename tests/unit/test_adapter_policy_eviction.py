"""Two-stage eviction (CoServe §4.3) and the LRU / FIFO baselines behind one interface."""

from __future__ import annotations

import pytest

from elasticmoe.adapter_policy.eviction import (
    EVICTION_POLICIES,
    Residency,
    TierView,
    eviction_order,
    eviction_policy,
    select_victims,
)
from elasticmoe.adapter_policy.graph import DependencyGraph, Node

COSERVE, LRU, FIFO = (eviction_policy(n) for n in ("coserve", "lru", "fifo"))


def make_view(sizes: dict[str, int], resident: dict[str, tuple[int, int]], edges=(), probabilities=None,
              pinned=(), queued=()) -> TierView:
    """`resident`: name -> (loaded_seq, used_seq)."""
    graph = DependencyGraph.build([Node(n, "lora", s) for n, s in sizes.items()], edges)
    return TierView(graph, {n: Residency(*seqs) for n, seqs in resident.items()}, probabilities or {},
                    frozenset(pinned), frozenset(queued))


def test_stage1_evicts_stranded_successors_largest_first_until_enough():
    # P1 -> S1, P1 -> S2 with P1 not resident; S3 depends on P2, which is resident; T is standalone.
    view = make_view({"P1": 1, "P2": 1, "S1": 2, "S2": 5, "S3": 1, "T": 3},
                     {"P2": (0, 9), "S1": (1, 1), "S2": (2, 2), "S3": (3, 3), "T": (4, 4)},
                     edges=[("P1", "S1"), ("P1", "S2"), ("P2", "S3")],
                     probabilities={"S1": 0.9, "S2": 0.8, "T": 0.0, "P2": 0.5, "S3": 0.4})
    assert eviction_order(COSERVE, view)[:2] == ["S2", "S1"]  # stage 1 despite high probabilities
    assert select_victims(COSERVE, view, 4) == ("S2",)  # the largest frees enough: one eviction
    assert select_victims(COSERVE, view, 6) == ("S2", "S1")
    # Beyond every stranded node, stage 2 by probability ascending: T (0.0), then S3 (0.4), then P2.
    assert select_victims(COSERVE, view, 9) == ("S2", "S1", "T")
    assert eviction_order(COSERVE, view) == ["S2", "S1", "T", "S3", "P2"]


def test_stage2_uses_preassessed_probability_where_lru_uses_history():
    # CoServe Fig. 4: expert 2 was used longer ago than expert 3 but is more likely to be used.
    view = make_view({"e1": 1, "e2": 1, "e3": 1}, {"e1": (0, 5), "e2": (1, 3), "e3": (2, 4)},
                     probabilities={"e1": 0.5, "e2": 0.4, "e3": 0.1})
    assert select_victims(LRU, view, 1) == ("e2",)
    assert select_victims(COSERVE, view, 1) == ("e3",)
    assert select_victims(FIFO, view, 1) == ("e1",)  # loaded first


def test_stage2_ties_go_to_the_larger_footprint_then_the_least_recently_used():
    view = make_view({"a": 1, "b": 2, "c": 1}, {"a": (0, 7), "b": (1, 8), "c": (2, 6)})
    assert eviction_order(COSERVE, view) == ["b", "c", "a"]


def test_pinned_never_queued_last_and_none_when_not_enough():
    view = make_view({"a": 1, "b": 1, "c": 1}, {"a": (0, 0), "b": (1, 1), "c": (2, 2)},
                     probabilities={"a": 0.1, "b": 0.2, "c": 0.3}, pinned={"b"}, queued={"a"})
    for policy in EVICTION_POLICIES.values():
        order = eviction_order(policy, view)
        assert "b" not in order and order[-1] == "a", policy.name
    assert select_victims(COSERVE, view, 1) == ("c",)
    assert select_victims(COSERVE, view, 2) == ("c", "a")
    assert select_victims(COSERVE, view, 3) is None  # b is pinned: the caller waits
    assert select_victims(COSERVE, view, 0) == ()


def test_zero_footprint_nodes_are_not_victims():
    view = make_view({"router": 0, "a": 1}, {"router": (0, 0), "a": (1, 1)})
    assert select_victims(LRU, view, 1) == ("a",)


def test_lru_and_fifo_orders():
    view = make_view({"a": 1, "b": 1, "c": 1}, {"a": (0, 9), "b": (1, 2), "c": (2, 5)})
    assert eviction_order(LRU, view) == ["b", "c", "a"]
    assert eviction_order(FIFO, view) == ["a", "b", "c"]


def test_registry_and_view_validation():
    assert sorted(EVICTION_POLICIES) == ["coserve", "fifo", "lru"]
    with pytest.raises(ValueError, match="adapter_eviction"):
        eviction_policy("random")
    with pytest.raises(ValueError, match="unknown nodes"):
        make_view({"a": 1}, {"a": (0, 0), "z": (0, 0)})
    with pytest.raises(ValueError, match="outside"):
        make_view({"a": 1}, {"a": (0, 0)}, probabilities={"a": 2.0})
    with pytest.raises(ValueError, match="precedes"):
        Residency(loaded_seq=3, used_seq=2)
