"""LoRA on the experts computes the same from an expert cache's pool as from the stacked experts:
the base weights are read at each expert's pool row, the LoRA factors by the expert itself."""

from __future__ import annotations

import pytest
import torch

from elasticmoe.adapters.lora_slots import ExpertLora

NUM_LOCAL, HIDDEN, INTER, RANK = 4, 16, 8, 2


@pytest.mark.parametrize("with_lora", [True, False])
def test_pool_rows_give_the_stacked_experts_outputs(with_lora):
    gen = torch.Generator().manual_seed(0)
    w13 = torch.randn(NUM_LOCAL, 2 * INTER, HIDDEN, generator=gen)
    w2 = torch.randn(NUM_LOCAL, HIDDEN, INTER, generator=gen)
    lora = ExpertLora(num_slots=2, num_local=NUM_LOCAL, max_rank=RANK, hidden=HIDDEN, inter=INTER,
                      dtype=torch.float32, top_k=1)
    for site in (lora.w13, lora.w2):
        site.a.copy_(torch.randn(site.a.shape, generator=gen))
        site.bt.copy_(torch.randn(site.bt.shape, generator=gen))
    slots = torch.tensor([0, 0, 2, 3, 3, 3])  # rows sorted by local expert; expert 1 has none
    xs = torch.randn(slots.numel(), HIDDEN, generator=gen)
    adapter = torch.tensor([0, -1, 1, 0, 1, -1]) if with_lora else torch.full((6,), -1)
    lora_slots = torch.stack((adapter.float(), torch.ones(6)), dim=1)  # one (slot, weight) pair per row
    want = lora.experts(xs, slots, lora_slots, w13, w2)

    # A pool of 6 rows holding the experts elsewhere (expert 1 not resident at all).
    pool_row = {0: 4, 2: 1, 3: 5}
    pool13, pool2 = torch.full((6, 2 * INTER, HIDDEN), float("nan")), torch.full((6, HIDDEN, INTER), float("nan"))
    for expert, row in pool_row.items():
        pool13[row], pool2[row] = w13[expert], w2[expert]
    slot_rows = torch.zeros(NUM_LOCAL, dtype=torch.long)
    for expert, row in pool_row.items():
        slot_rows[expert] = row
    got = lora.experts(xs, slots, lora_slots, pool13, pool2, slot_rows)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    if with_lora:  # the adapters matter, else the comparison could not tell
        plain = lora.experts(xs, slots, torch.stack((torch.full((6,), -1.0), torch.ones(6)), dim=1), w13, w2)
        assert not torch.allclose(plain, want)
