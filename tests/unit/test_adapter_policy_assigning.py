"""Request assigning across DP ranks (CoServe §4.2: K * n + B plus switch latency) and the
adapter-unaware least-loaded baseline, on hand-made rank states."""

from __future__ import annotations

import pytest

from elasticmoe.adapter_policy.assigning import (
    ASSIGNERS,
    RankState,
    RouteRequest,
    added_time,
    assigner,
    choose_rank,
    choose_rank_least_loaded,
    queue_time,
)
from elasticmoe.adapter_policy.profile import KindProfile

KINDS = {"lora": KindProfile(max_batch=2, k_s=1.0, b_s=2.0, load_s=5.0),
         "base": KindProfile(max_batch=4, k_s=0.5, b_s=1.0)}
FLAT = {"lora": KindProfile(max_batch=100, k_s=1.0, b_s=0.0, load_s=2.0), "base": KindProfile(1, 1.0, 0.0)}


def make_rank(queued: dict, resident: set[str] = frozenset(), kinds=KINDS, kind_of=None) -> RankState:
    return RankState(queued, frozenset(resident), kinds, kind_of or {})


def test_queue_time_is_k_n_plus_b_per_batch_plus_one_switch_per_missing_adapter():
    # a: 3 requests in 2 batches (max 2): 1*3 + 2*2 = 7, resident; base: 0.5 + 1 = 1.5.
    assert queue_time(make_rank({"a": 3, None: 1}, {"a"})) == pytest.approx(8.5)
    # b: 1*1 + 2 + its load 5 (not resident), once however many requests.
    assert queue_time(make_rank({"b": 1})) == pytest.approx(8.0)
    assert queue_time(make_rank({"b": 2})) == pytest.approx(9.0)
    assert queue_time(make_rank({})) == 0.0


def test_added_time_first_request_pays_k_plus_b_and_the_switch_unless_resident_or_queued():
    assert added_time(make_rank({}), RouteRequest("a")) == pytest.approx(1 + 2 + 5)
    assert added_time(make_rank({}, {"a"}), RouteRequest("a")) == pytest.approx(1 + 2)
    # A queued request of a: a is loaded behind it, the new one joins its batch (1 % 2 != 0).
    assert added_time(make_rank({"a": 1}), RouteRequest("a")) == pytest.approx(1)
    assert added_time(make_rank({"a": 2}), RouteRequest("a")) == pytest.approx(1 + 2)  # a new batch
    assert added_time(make_rank({None: 4}), RouteRequest(None)) == pytest.approx(0.5 + 1)
    assert RouteRequest(None, "lora").kind == "base"


def test_the_queue_that_keeps_the_longest_queue_shortest_ties_to_the_smallest_increase():
    # CoServe Fig. 8: queue 3 dictates the total time; queues 1 and 2 both keep it, queue 2 adds less.
    ranks = [make_rank({"x": 4}, {"x"}, FLAT), make_rank({"y": 5}, {"y", "a"}, FLAT),
             make_rank({"z": 10}, {"z"}, FLAT)]
    assert [queue_time(r) for r in ranks] == [4.0, 5.0, 10.0]
    assert [added_time(r, RouteRequest("a")) for r in ranks] == [3.0, 1.0, 3.0]
    assert choose_rank(ranks, RouteRequest("a")) == 1
    # Equal on every count: the lowest index.
    assert choose_rank([make_rank({}, kinds=FLAT), make_rank({}, kinds=FLAT)], RouteRequest("a")) == 0


def test_a_switch_is_worth_it_when_the_resident_rank_would_set_the_total():
    ranks = [make_rank({}, kinds=FLAT), make_rank({"a": 9}, {"a"}, FLAT)]
    assert choose_rank(ranks, RouteRequest("a")) == 0  # 0 + 1 + 2 < 9 + 1
    assert choose_rank_least_loaded(ranks, RouteRequest("a")) == 0
    ranks = [make_rank({"b": 1}, {"b"}, FLAT), make_rank({"a": 1}, {"a"}, FLAT)]
    assert choose_rank(ranks, RouteRequest("a")) == 1  # where a is resident
    assert choose_rank_least_loaded(ranks, RouteRequest("a")) == 0  # adapter-unaware: the first


def test_ranks_on_different_devices_use_their_own_latency_model():
    fast = {"lora": KindProfile(8, 0.1, 0.2, 1.0), "base": KindProfile(8, 0.1, 0.2)}
    slow = {"lora": KindProfile(2, 1.0, 2.0, 1.0), "base": KindProfile(2, 1.0, 2.0)}
    ranks = [make_rank({"a": 3}, {"a"}, slow), make_rank({"a": 3}, {"a"}, fast)]
    assert choose_rank(ranks, RouteRequest("a")) == 1


def test_kinds_per_adapter_and_errors():
    kinds = {**KINDS, "esft": KindProfile(4, 2.0, 0.0, load_s=10.0)}
    rank = make_rank({"e": 1}, kinds=kinds, kind_of={"e": "esft"})
    assert queue_time(rank) == pytest.approx(2 + 10)
    assert added_time(make_rank({}, kinds=kinds), RouteRequest("f", "esft")) == pytest.approx(2 + 10)
    with pytest.raises(ValueError, match="no latency model"):
        queue_time(make_rank({"e": 1}, kind_of={"e": "esft"}))
    with pytest.raises(ValueError, match="negative"):
        make_rank({"a": -1})
    with pytest.raises(ValueError, match="no ranks"):
        choose_rank([], RouteRequest(None))
    assert sorted(ASSIGNERS) == ["coserve", "parallel"] and assigner("parallel") is choose_rank_least_loaded
    with pytest.raises(ValueError, match="request_assigning"):
        assigner("random")
