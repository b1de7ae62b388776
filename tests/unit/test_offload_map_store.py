"""FineMoE's expert maps and their store (§4.1, §4.4): records, per-request distributions,
capacity C with deduplication by RDY, searches equal to eqs. 4-5, and the hybrid switch at d."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from elasticmoe.offload.map_store import ExpertMapStore, SearchedScores
from elasticmoe.offload.routing_map import RoutingMapRecord, request_layer_probs
from elasticmoe.offload.search_schedule import trajectory_length, trajectory_target, uses_semantic_search
from elasticmoe.offload.similarity import best_matches, redundancy_scores, semantic_scores, trajectory_scores


def one_hot_map(experts: list[int], num_experts: int = 4) -> torch.Tensor:
    """An expert map [L, E] routing all mass of layer l to `experts[l]`."""
    return torch.nn.functional.one_hot(torch.tensor(experts), num_experts).float()


def make_record(experts: list[int], embedding: list[float]) -> RoutingMapRecord:
    return RoutingMapRecord(torch.tensor(embedding), one_hot_map(experts))


def random_record(gen: torch.Generator, num_layers: int = 3, num_experts: int = 4, h: int = 5) -> RoutingMapRecord:
    probs = torch.softmax(torch.randn(num_layers, num_experts, generator=gen), dim=1)
    return RoutingMapRecord(torch.randn(h, generator=gen), probs)


def test_a_record_holds_one_distribution_per_layer():
    make_record([0, 1, 2], [1.0, 0.0])
    with pytest.raises(ValueError, match="sum to 1"):
        RoutingMapRecord(torch.ones(2), torch.full((3, 4), 0.5))
    with pytest.raises(ValueError, match=r"\[h\]"):
        RoutingMapRecord(torch.ones(1, 2), one_hot_map([0]))


def test_request_layer_probs_is_the_mean_over_each_requests_tokens():
    gate = torch.tensor([[1.0, 0.0], [0.0, 1.0], [0.5, 0.5]])  # request a: 2 tokens, b: 1
    assert request_layer_probs(gate, [2, 1]).tolist() == [[0.5, 0.5], [0.5, 0.5]]
    assert request_layer_probs(gate[:1], [1]).tolist() == [[1.0, 0.0]]
    with pytest.raises(ValueError):
        request_layer_probs(gate, [1, 1])


def test_store_appends_until_full_then_replaces_the_most_redundant_record():
    store = ExpertMapStore(capacity=3, num_layers=3, num_experts=4, prefetch_distance=1)
    slots = [store.add(make_record(e, v)) for e, v in (([0, 0, 0], [1.0, 0.0]), ([1, 1, 1], [0.0, 1.0]),
                                                        ([2, 2, 2], [1.0, 1.0]))]
    assert slots == [0, 1, 2] and len(store) == 3
    # routes like record 1 and has its embedding: RDY is highest against slot 1
    assert store.add(make_record([1, 1, 3], [0.0, 1.0])) == 1
    assert store.num_replaced == 1 and len(store) == 3
    assert store.maps[1].argmax(dim=1).tolist() == [1, 1, 3]
    # the new record is the one kept, and the others are untouched
    assert store.maps[0].argmax(dim=1).tolist() == [0, 0, 0]


def test_the_store_replaces_the_argmax_of_rdy_on_random_records():
    gen = torch.Generator().manual_seed(0)
    store = ExpertMapStore(capacity=6, num_layers=3, num_experts=4, prefetch_distance=1)
    for _ in range(6):
        store.add(random_record(gen))
    new = random_record(gen)
    rdy = redundancy_scores(new.embedding[None], store.embeddings, new.probs[None], store.maps, 1)
    assert store.add(new) == int(rdy.argmax())


@pytest.mark.parametrize("stored", [0, 4, 6])  # empty, filling up within the batch, full
def test_a_batch_of_records_goes_where_one_at_a_time_would(stored):
    gen = torch.Generator().manual_seed(stored)
    one_at_a_time = ExpertMapStore(capacity=6, num_layers=3, num_experts=4, prefetch_distance=1)
    for _ in range(stored):
        one_at_a_time.add(random_record(gen))
    one_at_a_time.mark_matched(torch.tensor([0]).numpy()[: min(stored, 1)])
    batched = copy.deepcopy(one_at_a_time)
    new = [random_record(gen) for _ in range(5)]
    new.insert(3, new[1])  # a repeat: the batch's own earlier record is the most redundant one
    slots = [one_at_a_time.add(r) for r in new]
    assert batched.insert_many(torch.stack([r.embedding for r in new]).numpy(),
                               torch.stack([r.probs for r in new]).numpy()) == slots
    assert torch.equal(batched.maps, one_at_a_time.maps) and torch.equal(batched.embeddings, one_at_a_time.embeddings)
    assert batched.num_replaced == one_at_a_time.num_replaced == stored  # six new records, six slots
    if stored == 6:
        assert slots[3] == slots[1]  # the repeat replaced its twin, not an older record


def test_records_no_search_matches_leave_once_stale_and_matched_ones_stay():
    """A new domain's maps replace each other by RDY; a past record no search matched for more than
    C insertions gains staleness and goes, while one still matched stays."""
    store = ExpertMapStore(capacity=3, num_layers=3, num_experts=4, prefetch_distance=1)
    for e, v in (([0, 0, 0], [1.0, 0.0]), ([1, 1, 1], [0.0, 1.0]), ([2, 2, 2], [1.0, 1.0])):
        store.add(make_record(e, v))
    kept = store.add(make_record([3, 3, 3], [-1.0, 0.0]))  # the new domain's first map takes a slot
    for _ in range(3):  # within C insertions: pure RDY, the new maps replace each other
        slot = store.add(make_record([3, 3, 3], [-1.0, 0.0]))
        store.mark_matched(torch.tensor([slot, 0]).numpy())  # searches use the new map and record 0
    maps = [m.argmax(dim=1).tolist() for m in store.maps]
    assert maps.count([3, 3, 3]) == 1 and [0, 0, 0] in maps and kept == slot
    for _ in range(4):  # past C: the unmatched past record goes; the matched one stays
        store.mark_matched(torch.tensor([0]).numpy())
        slot = store.add(make_record([3, 3, 3], [-1.0, 0.0]))
        store.mark_matched(torch.tensor([slot]).numpy())
    maps = [m.argmax(dim=1).tolist() for m in store.maps]
    assert [0, 0, 0] in maps and maps.count([3, 3, 3]) == 2, maps


def test_searches_equal_equations_4_and_5():
    gen = torch.Generator().manual_seed(1)
    store = ExpertMapStore(capacity=8, num_layers=3, num_experts=4, prefetch_distance=1)
    for _ in range(8):
        store.add(random_record(gen))
    queries = [random_record(gen) for _ in range(2)]
    emb = torch.stack([q.embedding for q in queries])
    index, score = store.search_semantic(emb)
    want_index, want_score = best_matches(semantic_scores(emb, store.embeddings))
    assert torch.equal(index, want_index) and torch.allclose(score, want_score, atol=1e-6)
    for n in (1, 2, 3):
        traj = torch.stack([q.probs[:n] for q in queries])
        index, score = store.search_trajectory(traj)
        want_index, want_score = best_matches(trajectory_scores(traj, store.maps[:, :n]))
        assert torch.equal(index, want_index) and torch.allclose(score, want_score, atol=1e-6)


def test_equal_scores_go_to_the_latest_record():
    store = ExpertMapStore(capacity=4, num_layers=3, num_experts=4, prefetch_distance=1)
    for experts in ([0, 0, 0], [1, 1, 1], [2, 2, 2]):  # three iterations of one prompt
        store.add(make_record(experts, [1.0, 2.0]))
    index, score = store.search_semantic(torch.tensor([[1.0, 2.0]]))
    assert index.tolist() == [2] and score.item() == pytest.approx(1.0)


def test_an_empty_store_cannot_be_searched():
    store = ExpertMapStore(capacity=2, num_layers=3, num_experts=4, prefetch_distance=1)
    with pytest.raises(ValueError, match="empty"):
        store.search_semantic(torch.ones(1, 2))
    store.add(make_record([0, 1, 2], [1.0, 0.0]))
    with pytest.raises(ValueError, match="embedding must have 2"):
        store.add(make_record([0, 1, 2], [1.0, 0.0, 0.0]))
    with pytest.raises(ValueError):
        store.search_trajectory(torch.ones(1, 4, 4))  # more layers than the model has


def test_hybrid_switch_at_the_prefetch_distance():
    # d = 2, L = 5 (paper: layers 1..2 semantic; layer l > 2 uses layers 1..l-2)
    assert [uses_semantic_search(layer, 2) for layer in range(5)] == [True, True, False, False, False]
    assert [trajectory_length(layer, 2) for layer in (2, 3, 4)] == [1, 2, 3]
    assert [trajectory_target(layer, 2, 5) for layer in range(5)] == [2, 3, 4, None, None]
    with pytest.raises(ValueError, match="semantic"):
        trajectory_length(1, 2)
    assert trajectory_target(0, 1, 1) is None  # a one-layer model: the semantic search guides it all


def test_the_layer_by_layer_search_scores_like_the_full_trajectory_search():
    torch.manual_seed(3)
    store = ExpertMapStore(capacity=8, num_layers=4, num_experts=5, prefetch_distance=1)
    for _ in range(6):
        store.add(RoutingMapRecord(torch.randn(3), torch.softmax(torch.randn(4, 5), dim=-1)))
    observed = torch.softmax(torch.randn(2, 4, 5), dim=-1)  # two iterations under way
    search = store.trajectory_search(batch=2)
    with pytest.raises(ValueError, match="no layer"):
        search.best()
    for n in range(1, 5):
        search.add(observed[:, n - 1])
        index, score = search.best()
        want_index, want_score = store.search_trajectory(observed[:, :n])
        assert index.tolist() == want_index.tolist()
        assert torch.allclose(torch.from_numpy(score), want_score, atol=1e-6)
        assert torch.equal(torch.from_numpy(search.layers_from(index, n - 1)), store.layers_from(want_index, n - 1))
    with pytest.raises(ValueError, match="4 layers"):
        search.add(observed[:, 0])
    store.add(RoutingMapRecord(torch.randn(3), torch.softmax(torch.randn(4, 5), dim=-1)))
    with pytest.raises(RuntimeError, match="changed"):  # a record added under the search
        search.best()


def test_a_restarted_search_scores_like_a_new_one_after_records_were_replaced():
    torch.manual_seed(5)
    store = ExpertMapStore(capacity=6, num_layers=3, num_experts=4, prefetch_distance=1)
    for _ in range(6):
        store.add(RoutingMapRecord(torch.randn(3), torch.softmax(torch.randn(3, 4), dim=-1)))
    search = store.trajectory_search(batch=2)
    search.add(torch.softmax(torch.randn(2, 4), dim=-1))
    for _ in range(3):  # replaced in place: the store's size holds, its norms change
        store.add(RoutingMapRecord(torch.randn(3), torch.softmax(torch.randn(3, 4), dim=-1)))
    assert not search.restart(batch=3)  # another batch size: a new search
    assert search.restart(batch=2) and search.num_layers == 0
    fresh = store.trajectory_search(batch=2)
    observed = torch.softmax(torch.randn(2, 3, 4), dim=-1)
    for layer in range(3):
        search.add(observed[:, layer])
        fresh.add(observed[:, layer])
        assert np.array_equal(search.scores(), fresh.scores())
    assert search.complete
    store.add(RoutingMapRecord(torch.randn(3), torch.softmax(torch.randn(3, 4), dim=-1)))
    grown = ExpertMapStore(capacity=8, num_layers=3, num_experts=4, prefetch_distance=1)
    grown.add(RoutingMapRecord(torch.randn(3), torch.softmax(torch.randn(3, 4), dim=-1)))
    growing = grown.trajectory_search(batch=1)
    grown.add(RoutingMapRecord(torch.randn(3), torch.softmax(torch.randn(3, 4), dim=-1)))
    assert not growing.restart(batch=1)  # a record more: the views are too short


def test_a_full_store_replaces_by_the_scores_its_searches_found():
    """RDY from an iteration's own semantic and whole-map trajectory scores picks the slots the
    store's own pass picks; scores of a store that changed since are refused."""
    gen = torch.Generator().manual_seed(9)
    store = ExpertMapStore(capacity=6, num_layers=3, num_experts=4, prefetch_distance=1)
    for _ in range(6):
        store.add(random_record(gen))
    new = [random_record(gen) for _ in range(3)]
    new.insert(2, new[0])  # a repeat within the batch: the later columns are the loop's own
    embeddings = torch.stack([r.embedding for r in new]).numpy()
    maps = torch.stack([r.probs for r in new]).numpy()
    search = store.trajectory_search(batch=4)
    for layer in range(3):
        search.add(maps[:, layer])
    searched = search.searched(store.semantic_scores(embeddings))
    np.testing.assert_array_equal(searched.trajectory, search.scores())
    reference = copy.deepcopy(store)
    assert store.insert_many(embeddings, maps, searched) == reference.insert_many(embeddings, maps)
    assert torch.equal(store.maps, reference.maps)
    of_seven = SearchedScores(*(np.zeros(shape, dtype=np.float32) for shape in ((4, 7), (4, 7), (4,), (7,))))
    with pytest.raises(RuntimeError, match="of 7 records, it now holds 6"):
        of_seven.check_against(store)


def test_the_layer_by_layer_search_breaks_ties_to_the_latest_record():
    store = ExpertMapStore(capacity=4, num_layers=2, num_experts=3, prefetch_distance=1)
    probs = torch.tensor([[0.7, 0.2, 0.1], [0.1, 0.1, 0.8]])
    for _ in range(3):  # the same map three times: equal scores
        store.add(RoutingMapRecord(torch.ones(2), probs))
    search = store.trajectory_search(batch=1)
    search.add(probs[None, 0])
    index, score = search.best()
    assert index.tolist() == [2] and score[0] == pytest.approx(1.0)
