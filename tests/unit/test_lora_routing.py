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
