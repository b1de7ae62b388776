"""CoServe §4.1 while the server runs (`adapter_policy.preload`): which adapter a preload copies in
and what it displaces, against hand-made tier views."""

from __future__ import annotations

from elasticmoe.adapter_policy.eviction import Residency, TierView, eviction_policy
from elasticmoe.adapter_policy.graph import DependencyGraph, Node
from elasticmoe.adapter_policy.preload import preload_choice

COSERVE = eviction_policy("coserve")


def view(resident: dict[str, float], candidates: dict[str, float], pinned=(), queued=(), routers=None,
         used=()) -> TierView:
    """Resident adapters (name -> probability, loaded in name order) and candidates out of the slots;
    `used`: residents that served a request since their load; `routers`: router -> (probability,
    adapters it routes to)."""
    routers = routers or {}
    nodes = [Node(n, "lora", 1) for n in [*resident, *candidates]] + [Node(r, "router", 0) for r in routers]
    graph = DependencyGraph.build(nodes, [(r, a) for r, (_, adapters) in routers.items() for a in adapters])
    probabilities = {**resident, **candidates}
    for r, (p, adapters) in routers.items():  # needed probability: an adapter's own plus its routers'
        probabilities[r] = p
        for a in adapters:
            probabilities[a] = min(1.0, probabilities[a] + p)
    residency = {n: Residency(i, i + 100 * (n in used)) for i, n in enumerate(sorted(resident))}
    residency.update(dict.fromkeys(routers, Residency(0, 0)))
    return TierView(graph, residency, probabilities, frozenset(pinned), frozenset(queued))


def test_a_free_slot_takes_the_most_probable_candidate():
    v = view({"a": 0.5}, {"b": 0.1, "c": 0.3})
    assert preload_choice(COSERVE, v, ["b", "c"], num_free=1) == ("c", None)


def test_a_full_tier_swaps_only_for_a_strictly_more_probable_adapter():
    v = view({"a": 0.5, "b": 0.05, "c": 0.2}, {"d": 0.3})
    assert preload_choice(COSERVE, v, ["d"], num_free=0) == ("d", "b")  # the least probable goes
    assert preload_choice(COSERVE, view({"a": 0.5, "b": 0.3}, {"d": 0.3}), ["d"], num_free=0) is None  # a tie stays
    assert preload_choice(COSERVE, view({"a": 0.5, "b": 0.4}, {"d": 0.3}), ["d"], num_free=0) is None


def test_pinned_and_queued_adapters_are_never_displaced():
    v = view({"a": 0.01, "b": 0.02, "c": 0.6}, {"d": 0.3}, pinned={"a"}, queued={"b"})
    assert preload_choice(COSERVE, v, ["d"], num_free=0) is None  # c is the only one free to go, and more probable
    v = view({"a": 0.01, "b": 0.02, "c": 0.1}, {"d": 0.3}, pinned={"a"}, queued={"b"})
    assert preload_choice(COSERVE, v, ["d"], num_free=0) == ("d", "c")


def test_nothing_without_a_positive_probability_or_a_candidate():
    assert preload_choice(COSERVE, view({}, {"d": 0.0}), ["d"], num_free=2) is None
    assert preload_choice(COSERVE, view({"a": 0.1}, {}), [], num_free=1) is None


def test_a_router_makes_its_adapters_needed():
    # a's own probability is low, but a router used half the time needs it resident: b goes instead.
    v = view({"a": 0.05, "b": 0.1}, {"d": 0.3}, routers={"router:r": (0.5, ["a"])})
    assert preload_choice(COSERVE, v, ["d"], num_free=0) == ("d", "b")


def test_ties_between_candidates_go_to_the_first_name():
    v = view({}, {"y": 0.2, "x": 0.2})
    assert preload_choice(COSERVE, v, ["y", "x"], num_free=1) == ("x", None)


def test_an_adapter_that_served_requests_goes_only_for_one_likelier_than_all_outside():
    # b served a request since its load: displacing it for d pays only if d's next request likely
    # comes before any other adapter's out of the slots (else that one displaces d again first).
    v = view({"a": 0.5, "b": 0.05}, {"d": 0.3}, used={"b"})
    assert preload_choice(COSERVE, v, ["d"], num_free=0, outside_mass=0.4) is None
    assert preload_choice(COSERVE, v, ["d"], num_free=0, outside_mass=0.2) == ("d", "b")
    # An unused resident goes whatever the mass outside: the slots only gain.
    v = view({"a": 0.5, "b": 0.05, "c": 0.01}, {"d": 0.3}, used={"c"})
    assert preload_choice(COSERVE, v, ["d"], num_free=0, outside_mass=0.9) == ("d", "b")
