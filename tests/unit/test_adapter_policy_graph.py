"""The dependency graph (CoServe §4.3) and usage probabilities (profile > declared > observed)."""

from __future__ import annotations

import random

import pytest

from elasticmoe.adapter_policy.graph import DependencyGraph, Node
from elasticmoe.adapter_policy.usage import (
    RateEstimator,
    check_probability,
    needed_probability,
    usage_probabilities,
)


def make_graph(sizes: dict[str, int], edges: list[tuple[str, str]] = (), kind: str = "lora") -> DependencyGraph:
    return DependencyGraph.build([Node(n, kind, s) for n, s in sizes.items()], edges)


def test_predecessors_successors_and_stranded_successors():
    # A router R mixes A and B; an ESFT adapter E reaches base experts x and y; x is shared (as
    # CoServe's detection expert shared by several classification experts).
    g = make_graph({"R": 0, "A": 1, "B": 1, "E": 4, "F": 4, "x": 2, "y": 2},
                   [("R", "A"), ("R", "B"), ("E", "x"), ("E", "y"), ("F", "x")])
    assert g.predecessors("A") == {"R"} and g.successors("R") == {"A", "B"}
    assert g.predecessors("x") == {"E", "F"} and g.predecessors("R") == frozenset()
    # x is stranded only while neither E nor F is resident; a node without predecessors never is.
    assert g.stranded({"x", "y", "A"}) == ["A", "x", "y"]
    assert g.stranded({"F", "x", "y"}) == ["y"]
    assert g.stranded({"R", "A", "E"}) == []
    assert not g.is_stranded("E", set())
    assert "A" in g and "Q" not in g and g.footprint("E") == 4


def test_graph_rejects_bad_nodes_and_edges():
    with pytest.raises(ValueError, match="unknown node"):
        make_graph({"A": 1}, [("A", "B")])
    with pytest.raises(ValueError, match="itself"):
        make_graph({"A": 1}, [("A", "A")])
    with pytest.raises(ValueError, match="twice"):
        DependencyGraph.build([Node("A", "lora", 1), Node("A", "lora", 2)])
    with pytest.raises(ValueError, match="footprint"):
        Node("A", "lora", -1)
    with pytest.raises(ValueError, match="filed under"):
        DependencyGraph({"B": Node("A", "lora", 1)})


def test_usage_sources_in_order_profile_declared_observed():
    p = usage_probabilities(["a", "b", "c", "d"], profiled={"a": 0.5}, declared={"a": 0.1, "b": 0.2},
                            observed={"a": 9.0, "c": 3.0, "d": 1.0})
    # a: profile wins over its declaration; b: declared; c, d share the 0.3 left by their rates.
    assert p == pytest.approx({"a": 0.5, "b": 0.2, "c": 0.225, "d": 0.075})


def test_observed_fallback_is_even_without_rates_and_never_negative():
    assert usage_probabilities(["a", "b"], observed={}) == pytest.approx({"a": 0.5, "b": 0.5})
    # Declarations over 1 leave nothing to share: the unknown ones get 0, not a negative share.
    assert usage_probabilities(["a", "b", "c"], declared={"a": 0.7, "b": 0.6}, observed={"c": 5.0})["c"] == 0.0
    with pytest.raises(ValueError, match="usage_probability"):
        usage_probabilities(["a"], declared={"a": 1.5})
    for bad in (-0.1, 1.01, True, "0.5"):
        with pytest.raises(ValueError, match="usage_probability"):
            check_probability(bad)  # type: ignore[arg-type]


def test_needed_probability_adds_what_reaches_a_node_once():
    # R routes to A and B; A is also asked for directly; a diamond R -> A -> x, R -> B -> x.
    g = make_graph({"R": 0, "A": 1, "B": 1, "x": 1}, [("R", "A"), ("R", "B"), ("A", "x"), ("B", "x")])
    need = needed_probability(g, {"R": 0.3, "A": 0.2, "B": 0.1, "x": 0.0})
    assert need == pytest.approx({"R": 0.3, "A": 0.5, "B": 0.4, "x": 0.6})  # R counted once for x
    assert needed_probability(g, {"R": 0.9, "A": 0.9})["A"] == 1.0  # capped


def test_rate_estimator_is_an_ema_over_tracked_names():
    rates = RateEstimator(decay=0.5)
    rates.update({"a": 4})
    rates.update({"b": 2})
    assert rates.rates(["a", "b", "c"]) == pytest.approx({"a": 1.0, "b": 1.0, "c": 0.0})
    rates.forget("a")  # unloaded: no longer tracked, and a later "a" starts at 0
    rates.update({})
    assert rates.rates(["a", "b"]) == pytest.approx({"a": 0.0, "b": 0.5})
    rates.update({"a": 2})
    assert rates.rates(["a"]) == pytest.approx({"a": 1.0})
    with pytest.raises(ValueError, match="decay"):
        RateEstimator(decay=1.0)


def test_rate_estimator_equals_the_eager_average_pass_by_pass():
    """Lazily decayed rates (a pass costs its arrivals only) equal the average updated over every
    name at every pass."""
    rng = random.Random(3)
    names, decay = [f"n{i}" for i in range(6)], 0.9
    lazy, eager = RateEstimator(decay), dict.fromkeys(names, 0.0)
    for _ in range(200):
        counts = {n: rng.randint(1, 3) for n in rng.sample(names, rng.randint(0, 2))}
        lazy.update(counts)
        eager = {n: decay * eager[n] + (1 - decay) * counts.get(n, 0) for n in names}
        assert lazy.rates(names) == pytest.approx(eager, rel=1e-9, abs=1e-12)
