"""Baseline `lfu` — MoE-Infinity (Xue et al., 2024) as FineMoE describes and evaluates it
(§2.5, §4.2, §6.6): coarse, request-level activation tracking and LFU eviction.

- Each request accumulates an expert activation matrix (EAM) [L, E]: how many of its tokens
  each expert received at each layer, over all its iterations so far.
- A finished request's EAM joins a collection of at most C matrices (the oldest leaves
  first; MoE-Infinity keeps a bounded collection, how it chooses what to drop is not ours
  to copy here).
- Prediction: the request's EAM as it stands (previous iterations plus this iteration's
  layers so far) is matched by cosine similarity to the collection; the best matrix's
  row l, normalised, is the predicted activation ratio of layer l. A request with no
  activation yet (a prefill before its first layer) takes the collection's total instead:
  "the most popular experts across all historical data points" (FineMoE §4.2).
- Prefetching: the same distance d as FineMoE (layers 0..d-1 at the start of the
  iteration, layer l + d after layer l), the top-k experts of the predicted ratio per
  request (a static top-K; FineMoE's threshold is what this baseline lacks).
- Eviction: least frequently used (`CacheState.num_uses`), then least recently used.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

import numpy as np
import torch

from elasticmoe.offload.cache_state import CacheState, ExpertKey
from elasticmoe.offload.policy import PolicyConfig, PrefetchPlan, RequestContext
from elasticmoe.offload.ranking import PlanMaker, pick_victims
from elasticmoe.offload.search_schedule import trajectory_target
from elasticmoe.offload.similarity import best_matches, cosine_scores


def count_activations(topk_ids: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Tokens routed to each expert by one layer: `topk_ids` [T, k] -> counts [E]."""
    return torch.bincount(topk_ids.flatten(), minlength=num_experts).float()


def activation_ratio(matrix: torch.Tensor) -> torch.Tensor:
    """An EAM [L, E] with each row scaled to sum to 1 (rows of zeros stay zero)."""
    return matrix / matrix.sum(dim=1, keepdim=True).clamp_min(1e-12)


class ActivationMatrixCollection:
    """At most `capacity` EAMs [L, E] of finished requests, oldest replaced first."""

    def __init__(self, capacity: int, num_layers: int, num_experts: int) -> None:
        if capacity < 1:
            raise ValueError(f"activation matrix collection: capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        self._matrices = torch.zeros(capacity, num_layers, num_experts)
        self._size = 0
        self._next = 0  # the slot the next matrix takes

    def __len__(self) -> int:
        return self._size

    @property
    def matrices(self) -> torch.Tensor:
        return self._matrices[: self._size]

    def add(self, matrix: torch.Tensor) -> None:
        self._matrices[self._next] = matrix
        self._next = (self._next + 1) % self.capacity
        self._size = min(self._size + 1, self.capacity)

    def predict(self, matrix: torch.Tensor) -> torch.Tensor | None:
        """The predicted activation ratio [L, E] for a request whose EAM is `matrix`, or
        None with an empty collection."""
        if self._size == 0:
            return None
        if float(matrix.sum()) == 0.0:
            return activation_ratio(self.matrices.sum(dim=0))
        index, _ = best_matches(cosine_scores(matrix.flatten()[None], self.matrices.flatten(1)))
        return activation_ratio(self.matrices[int(index[0])])


class LFUPolicy:
    """`OffloadPolicy` of MoE-Infinity: request-level activation matrices, LFU eviction."""

    name = "lfu"
    needs_next_layer_gate = False
    observes_layers = True

    def __init__(self, config: PolicyConfig) -> None:
        self.config = config
        shape = (config.num_layers, config.num_experts)
        self.collection = ActivationMatrixCollection(config.store_capacity, *shape)
        self._matrices: dict[str, torch.Tensor] = {}  # request id -> its EAM so far
        self._requests: list[RequestContext] = []
        self._current_layer = -1
        self._planned = np.zeros(shape, dtype=np.bool_)
        self._planned_probs = np.zeros(shape, dtype=np.float64)
        self._plans = PlanMaker(self._planned, self._planned_probs)  # reads both in place

    def begin_iteration(self, requests: Sequence[RequestContext]) -> None:
        if not requests:
            raise ValueError("begin_iteration: an iteration needs at least one request")
        self._requests = list(requests)
        self._current_layer = -1
        self._planned[:] = False
        self._planned_probs[:] = 0.0
        for request in requests:
            if request.request_id not in self._matrices:
                self._matrices[request.request_id] = torch.zeros(self.config.num_layers, self.config.num_experts)
        for layer in range(min(self.config.prefetch_distance, self.config.num_layers)):
            self._plan_layer(layer)

    def observe_layer(self, layer: int, gate_probs: torch.Tensor, topk_ids: torch.Tensor,
                      next_gate_probs: torch.Tensor | None = None) -> None:
        if layer != self._current_layer + 1:
            raise ValueError(f"observe_layer: expected layer {self._current_layer + 1}, got {layer}")
        rows = topk_ids.split([r.num_tokens for r in self._requests])
        for request, request_ids in zip(self._requests, rows, strict=True):
            self._matrices[request.request_id][layer] += count_activations(request_ids, self.config.num_experts)
        self._current_layer = layer
        target = trajectory_target(layer, self.config.prefetch_distance, self.config.num_layers)
        if target is not None:
            self._plan_layer(target)

    def prefetch_plan(self, cache: CacheState) -> PrefetchPlan:
        return self._plans.plan(self._current_layer, cache)

    def choose_victims(self, cache: CacheState, num_victims: int, protected: Collection[ExpertKey],
                       for_layers: Sequence[int] = ()) -> list[ExpertKey]:
        return pick_victims(cache, -cache.num_uses.astype(np.float64), num_victims, protected)

    def end_iteration(self, finished_request_ids: Collection[str] = ()) -> None:
        for request_id in finished_request_ids:
            matrix = self._matrices.pop(request_id, None)
            if matrix is not None and float(matrix.sum()) > 0.0:
                self.collection.add(matrix)
        self._requests = []
        self._current_layer = -1
        self._planned[:] = False

    def _plan_layer(self, layer: int) -> None:
        for request in self._requests:
            ratio = self.collection.predict(self._matrices[request.request_id])
            if ratio is None:
                return
            probs, experts = torch.topk(ratio[layer], self.config.top_k)
            for expert, prob in zip(experts.tolist(), probs.tolist(), strict=True):
                self._planned[layer, expert] = True
                self._planned_probs[layer, expert] = max(self._planned_probs[layer, expert], prob)
