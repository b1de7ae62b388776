"""FineMoE's per-expert decisions (§4.3, §4.5): how many experts of a searched map to
prefetch, in which order, and which cached expert to evict first. Pure functions.

Layers here are 0-based (the paper counts from 1); only differences of layers enter.
"""

from __future__ import annotations

from typing import overload

import numpy as np
import numpy.typing as npt
import torch

# The eviction priority 1/(p * freq) is undefined at p = 0 (an expert the searched map
# gives no mass); p is floored here so such experts rank by frequency among themselves.
PROB_FLOOR = 1e-6

# `iteration_floor` rounds the expected number of active experts up, less this much: float32 maps
# sum to 1 only to ~1e-7, and an expectation a hair over an integer must not ask for one more.
FLOOR_TOLERANCE = 1e-3


def selection_threshold(score: float | npt.ArrayLike) -> float | npt.NDArray[np.float64]:
    """§4.3: `delta_l = Clip(1 - score, 0, 1)` for a searched map of similarity `score` in
    [-1, 1]: the less the map resembles the request, the more probability mass to cover.
    Elementwise over an array of scores (computed in float64)."""
    return np.clip(1.0 - np.asarray(score, dtype=np.float64), 0.0, 1.0)


def minimum_expert_set(probs: torch.Tensor | npt.ArrayLike, threshold: float, top_k: int,
                       num_tokens: int = 1) -> list[int]:
    """Eqs. 6-8: the fewest experts whose summed probability reaches `threshold` (eq. 7),
    and at least `iteration_floor` of them (eq. 8: `top_k` for an iteration of one token),
    picked greedily by descending probability (which minimises the count, eq. 6). `probs` [E];
    returns expert ids, most probable first; ties go to the lower id."""
    p = probs.detach().double().numpy() if isinstance(probs, torch.Tensor) else np.asarray(probs, dtype=np.float64)
    if p.ndim != 1:
        raise ValueError(f"minimum expert set: need probs [E], got {tuple(p.shape)}")
    order, counts = minimum_expert_sets(p[None], np.array([threshold]), top_k, np.array([num_tokens]))
    return order[0, : counts[0]].tolist()


def iteration_floor(probs: npt.ArrayLike, num_tokens: npt.ArrayLike, top_k: int) -> npt.NDArray[np.int64]:
    """Eq. 8's lower bound on a minimum expert set, for iterations of `num_tokens` [B] tokens
    whose layer is predicted by `probs` [B, E].

    The paper's bound is K, the experts one token activates. An iteration of T tokens (a
    prefill, or a chunk of one) activates the union of its tokens' top-K, which for T > 1 is
    larger: with each token picking expert j with probability `q_j = min(1, K p_j)`, the union
    holds `sum_j 1 - (1 - q_j)^T` experts on average. The bound is that expectation rounded up
    (at least K, at most E); at T = 1 it is K exactly, as in the paper. Without it a prefill
    would plan K experts a layer against the dozens it routes to (docs/offload.md)."""
    p = np.asarray(probs, dtype=np.float64)
    tokens = np.asarray(num_tokens, dtype=np.int64)
    if tokens.shape != p.shape[:1] or (tokens < 1).any():
        raise ValueError(f"iteration floor: need num_tokens >= 1 for each of {p.shape[0]} rows, got {tokens}")
    q = np.minimum(1.0, top_k * p)
    expected = (1.0 - (1.0 - q) ** tokens[:, None].astype(np.float64)).sum(axis=1)
    floors = np.ceil(expected - FLOOR_TOLERANCE).astype(np.int64)
    return np.where(tokens == 1, top_k, np.clip(floors, top_k, p.shape[1]))


def minimum_expert_sets(probs: npt.ArrayLike, thresholds: npt.ArrayLike, top_k: int,
                        num_tokens: npt.ArrayLike | None = None) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64]]:
    """`minimum_expert_set` of B distributions `probs` [B, E] at `thresholds` [B] for
    iterations of `num_tokens` [B] tokens (None: one each) at once: (each row's expert ids by
    descending probability, ties to the lower id [B, E]; how many of them form its set [B]).

    NumPy, not torch: this runs per layer of every step on a few dozen values, where torch's
    per-op dispatch costs more than the work."""
    p = np.asarray(probs, dtype=np.float64)
    num_experts = p.shape[1]
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"minimum expert set: top_k must be in [1, {num_experts}], got {top_k}")
    order = np.argsort(-p, axis=1, kind="stable")  # stable on -p: equal probabilities in id order
    covered = np.cumsum(np.take_along_axis(p, order, axis=1), axis=1)
    # The first prefix reaching the threshold; rounding can leave the total a hair under a
    # threshold of 1, and then every expert is needed.
    reached = covered >= np.asarray(thresholds, dtype=np.float64)[:, None]
    counts = np.where(reached[:, -1], reached.argmax(axis=1) + 1, num_experts)
    if num_tokens is None:
        return order, np.maximum(counts, top_k)
    return order, np.maximum(counts, iteration_floor(p, num_tokens, top_k))


@overload
def prefetch_priority(prob: float, layer: int, current_layer: int) -> float: ...
@overload
def prefetch_priority(prob: float | npt.NDArray[np.float64], layer: npt.NDArray[np.int64],
                      current_layer: int) -> npt.NDArray[np.float64]: ...
def prefetch_priority(prob: float | npt.NDArray[np.float64], layer: int | npt.NDArray[np.int64],
                      current_layer: int) -> float | npt.NDArray[np.float64]:
    """§4.5: `PRI^prefetch_{l,j} = p_{l,j} / (l - l_now)`: likelier experts first, and nearer
    layers first. `current_layer` is the last layer routed (-1 before layer 0). Elementwise
    over arrays of `prob` and `layer`."""
    if isinstance(layer, int):  # one item (`ranking` ranks a plan's few items in Python)
        if layer <= current_layer:
            raise ValueError(f"prefetch priority: layer {layer} is not after the current layer {current_layer}")
        return prob / (layer - current_layer)
    distance = np.subtract(layer, current_layer)
    if (distance < 1).any():  # the method, not `np.any`: this runs per MoE layer of every step
        raise ValueError(f"prefetch priority: layer {layer} is not after the current layer {current_layer}")
    return prob / distance


def eviction_priority(prob: npt.ArrayLike, num_visits: npt.ArrayLike) -> npt.NDArray[np.float64]:
    """§4.5: `PRI^evict_{l,j} = 1 / (p_{l,j} * freq_{l,j})`: evict first what is rarely
    visited and unlikely under the searched map. Elementwise over arrays (e.g. [L, E]).

    `freq` is `num_visits + 1`: the load that brought an expert in counts as its first visit
    (an expert prefetched for the next layer has no visit yet; with `freq = 0` it would be
    the first victim, always). `p` is floored at `PROB_FLOOR`.
    """
    p = np.maximum(np.asarray(prob, dtype=np.float64), PROB_FLOOR)
    return 1.0 / (p * (np.asarray(num_visits, dtype=np.float64) + 1.0))
