"""FineMoE's expert map (§4.1): the gate's probability distribution at every MoE layer for
one iteration of one request, `map_i = {P_1^(i), ..., P_L^(i)}`, kept with the iteration's
semantic embedding. Named `RoutingMapRecord` here so it is not mistaken for the ESFT
rerouting table `elasticmoe.adapters.expert_map.ExpertMap`.

A layer's gate gives one distribution per token; an iteration that feeds a request several
tokens (a prefill) has one `P_l` for the request: the mean of its tokens' distributions,
again a distribution (non-negative, sums to 1) whose mass on an expert is the share of the
request's routing probability it received (`request_layer_probs`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

_SUM_TOLERANCE = 1e-3


@dataclass(frozen=True, slots=True, eq=False)
class RoutingMapRecord:
    """One iteration's expert map `probs` [L, E] (rows are distributions) and semantic
    embedding `embedding` [h]."""

    embedding: torch.Tensor
    probs: torch.Tensor

    def __post_init__(self) -> None:
        if self.embedding.dim() != 1 or self.embedding.numel() == 0:
            raise ValueError(f"routing map: embedding must be [h], got {tuple(self.embedding.shape)}")
        if self.probs.dim() != 2:
            raise ValueError(f"routing map: probs must be [L, E], got {tuple(self.probs.shape)}")
        if bool((self.probs < 0).any()):
            raise ValueError("routing map: negative probability")
        sums = self.probs.sum(dim=1)
        if not torch.allclose(sums, torch.ones_like(sums), atol=_SUM_TOLERANCE):
            raise ValueError(f"routing map: every layer's probabilities must sum to 1, got {sums.tolist()}")


def request_layer_probs(gate_probs: torch.Tensor, num_tokens: Sequence[int]) -> torch.Tensor:
    """One layer's gate output `gate_probs` [T, E] for a batch whose requests own consecutive
    rows (`num_tokens` of them each, in order) -> each request's `P_l` [B, E]: the mean over
    its rows."""
    if gate_probs.dim() != 2 or gate_probs.shape[0] != sum(num_tokens):
        raise ValueError(f"gate probs: need [{sum(num_tokens)}, E] for tokens {list(num_tokens)}, "
                         f"got {tuple(gate_probs.shape)}")
    if len(num_tokens) == 1:
        return gate_probs.float().mean(dim=0, keepdim=True)
    return torch.stack([rows.float().mean(dim=0) for rows in gate_probs.split(list(num_tokens))])
