"""Per-token LoRA routing by vocabulary range (MoLoRA §3.1): parsing and the token -> slot map."""

from __future__ import annotations

import pytest
import torch

from elasticmoe.adapters.lora_routing import VocabRouting
from elasticmoe.errors import InvalidRequestError


def test_tokens_go_to_their_ranges_adapter():
    r = VocabRouting.from_json({"type": "vocab", "breaks": [100, 200], "adapters": ["text", None, "image"]}, 300)
    assert r.names == {"text", "image"}
    slots = r.token_slots(torch.tensor([0, 99, 100, 199, 200, 299]), torch.tensor([4, -1, 7]))
    assert slots.tolist() == [4, 4, -1, -1, 7, 7]  # ranges are [0, 100), [100, 200), [200, 300)


@pytest.mark.parametrize(
    "obj",
    [
        "vocab",
        {"type": "learned"},
        {"breaks": [100], "adapters": ["a"]},  # one name per range: 2 needed
        {"breaks": [0], "adapters": ["a", "b"]},
        {"breaks": [300], "adapters": ["a", "b"]},
        {"breaks": [200, 100], "adapters": ["a", "b", "c"]},
        {"breaks": [100, 100], "adapters": ["a", "b", "c"]},
        {"breaks": ["x"], "adapters": ["a", "b"]},
        {"breaks": [True], "adapters": ["a", "b"]},
        {"breaks": [100], "adapters": [None, None]},
        {"breaks": [100], "adapters": ["a", 3]},
    ],
)
def test_bad_routing_names_the_field(obj):
    with pytest.raises(InvalidRequestError) as info:
        VocabRouting.from_json(obj, 300)
    assert info.value.param == "lora_routing"


def test_weighted_groups_are_equation_8():
    """Each token's LoRA output is the router-weighted sum over its top-k adapters (MoLoRA eq. 8)."""
    from elasticmoe.layers.lora import LoraGroups

    g = torch.Generator().manual_seed(0)
    num_adapters, r, d_in, d_out, tokens = 3, 4, 8, 6, 5
    a, b = torch.randn(num_adapters, r, d_in, generator=g), torch.randn(num_adapters, d_out, r, generator=g)
    x = torch.randn(tokens, d_in, generator=g)
    keys = torch.tensor([[0, 2], [1, -1], [2, 0], [-1, -1], [1, 0]])
    weights = torch.tensor([[0.7, 0.3], [1.0, 0.0], [0.5, 0.5], [0.0, 0.0], [0.2, 0.8]])
    got = LoraGroups.build(keys, weights).delta(x, a, b.transpose(1, 2).contiguous())  # B as the sites keep it
    want = torch.zeros(tokens, d_out)
    for t in range(tokens):
        for key, w in zip(keys[t].tolist(), weights[t].tolist(), strict=True):
            if key >= 0:
                want[t] += w * (x[t] @ a[key].T @ b[key].T)
    torch.testing.assert_close(got, want)


def test_router_is_a_two_layer_gelu_mlp_with_topk_softmax():
    from elasticmoe.adapters.lora_router import random_router

    router = random_router(("a", "b", "c"), hidden_size=16, top_k=2, seed=1)
    x = torch.randn(7, 16)
    logits = torch.nn.functional.gelu(x @ router.w1.T + router.b1) @ router.w2.T + router.b2
    idx, w = router.route(x)
    top = logits.topk(2, dim=-1)
    assert torch.equal(idx, top.indices)
    torch.testing.assert_close(w, torch.softmax(top.values, dim=-1))
    assert router.w1.shape == (64, 16)  # hidden 64, eq. 9
