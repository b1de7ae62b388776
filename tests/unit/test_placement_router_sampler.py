from __future__ import annotations

import pytest
import torch

from elasticmoe.engine.request import Request
from elasticmoe.engine.sampler import Sampler, _apply_top_k_top_p
from elasticmoe.layers.experts import grouped_experts, swiglu_mlp
from elasticmoe.layers.router import group_limited_topk, softmax_topk
from elasticmoe.parallel.dispatch import LocalDispatcher
from elasticmoe.parallel.expert_placement import ExpertPlacement
from elasticmoe.sampling_params import SamplingParams


def test_balanced_placement():
    p = ExpertPlacement.balanced(10, 3)
    assert [len(p.local_expert_ids(r)) for r in range(3)] == [4, 3, 3]
    assert p.local_expert_ids(1) == (4, 5, 6)
    with pytest.raises(ValueError):
        ExpertPlacement.balanced(2, 3)
    with pytest.raises(ValueError):
        ExpertPlacement(2, 1, (0, 0), (0, 2))  # slot gap


def test_permuted_placement_local_order():
    p = ExpertPlacement(4, 2, expert_to_rank=(1, 0, 1, 0), expert_to_slot=(1, 0, 0, 1))
    assert p.local_expert_ids(0) == (1, 3)
    assert p.local_expert_ids(1) == (2, 0)


def test_softmax_topk_renormalises():
    logits = torch.tensor([[1.0, 2.0, 3.0, 0.0]])
    w, ids = softmax_topk(logits, 2, renormalize=True)
    assert ids.tolist() == [[2, 1]]
    assert w.sum().item() == pytest.approx(1.0)


def test_group_limited_topk_only_picks_from_best_groups():
    # 4 groups of 2; group 3 has the single best expert, group 0 the next best.
    logits = torch.tensor([[5.0, 4.9, 0.0, 0.0, 4.8, 4.7, 6.0, 0.0]])
    _, ids = group_limited_topk(logits, top_k=3, num_groups=4, topk_group=2)
    assert sorted(ids[0].tolist()) == [0, 1, 6]  # 4 and 5 (group 2) excluded despite high scores
    empty_w, empty_ids = group_limited_topk(torch.empty(0, 8), 3, 4, 2)
    assert empty_ids.shape == (0, 3)


def test_grouped_experts_equals_per_token_loop():
    torch.manual_seed(0)
    x = torch.randn(9, 8)
    w13, w2 = torch.randn(4, 6, 8), torch.randn(4, 8, 3)
    slots = torch.tensor([3, 0, 0, 2, 3, 1, 0, 2, 2])
    expected = torch.stack([swiglu_mlp(x[i], w13[s], w2[s]) for i, s in enumerate(slots.tolist())])
    torch.testing.assert_close(grouped_experts(x, slots, w13, w2), expected)


def test_local_dispatcher_weights_and_combines():
    x = torch.randn(3, 4)
    ids = torch.tensor([[0, 1], [1, 1], [0, 0]])
    w = torch.tensor([[0.5, 0.5], [1.0, 2.0], [0.25, 0.25]])
    out = LocalDispatcher(ExpertPlacement.single(2))(x, ids, w, lambda h, s, _: h * (s + 1).unsqueeze(-1).to(h.dtype))
    torch.testing.assert_close(out, x * torch.tensor([[1.5], [6.0], [0.5]]))


def make_req(**kw) -> Request:
    return Request("r", [1], 1, SamplingParams(**kw), 100)


def test_top_k_top_p_masks():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    kept = _apply_top_k_top_p(logits, torch.tensor([0]), torch.tensor([0.7])).isfinite()
    assert kept.tolist() == [[True, True, False, False]]  # 0.5 < 0.7, 0.8 covers it
    kept = _apply_top_k_top_p(logits, torch.tensor([1]), torch.tensor([1.0])).isfinite()
    assert kept.tolist() == [[True, False, False, False]]


def test_sampler_greedy_seeded_and_restricted():
    sampler = Sampler(seed=0)
    logits = torch.tensor([[0.0, 3.0, 1.0, 2.0]]).repeat(3, 1)
    reqs = [make_req(temperature=0), make_req(temperature=1.0, seed=3), make_req(temperature=5.0, top_k=1)]
    first = sampler(logits, reqs).token_ids
    assert first[0] == 1 and first[2] == 1
    again = sampler(logits, [make_req(temperature=0), make_req(temperature=1.0, seed=3), reqs[2]]).token_ids
    assert again[1] == first[1]  # same seed, same draw
    draws = {sampler(logits[:1], [make_req(temperature=1.0)]).token_ids[0] for _ in range(200)}
    assert draws == {0, 1, 2, 3}


def test_grouped_experts_never_read_unmapped_adapter_rows():
    """A virtual weight tensor [E + N*E_max]: only some adapter rows hold weights (NaN elsewhere
    stands in for unmapped pages). Decode-like batches (padded bmm over the base slots) and
    mixed base + adapter rows give the per-row reference and never touch a NaN row."""
    from elasticmoe.layers.experts import grouped_experts_sorted, swiglu_mlp

    torch.manual_seed(0)
    base, extra, h, i = 8, 12, 16, 8
    w13 = torch.full((base + extra, 2 * i, h), float("nan"))
    w2 = torch.full((base + extra, h, i), float("nan"))
    mapped = list(range(base)) + [base + 1, base + 6]
    for s in mapped:
        w13[s], w2[s] = torch.randn(2 * i, h), torch.randn(h, i)
    for slots in ([s for s in range(base) for _ in range(2)], [0, 1, 2, 3, 4, 5, 6, 7, base + 1, base + 6, base + 6]):
        sorted_slots = torch.tensor(sorted(slots))
        xs = torch.randn(len(slots), h)
        got = grouped_experts_sorted(xs, sorted_slots, w13, w2, dense_slots=base)
        want = torch.stack([swiglu_mlp(x[None], w13[s], w2[s])[0] for x, s in zip(xs, sorted_slots.tolist(), strict=False)])
        assert not got.isnan().any()
        torch.testing.assert_close(got, want)
