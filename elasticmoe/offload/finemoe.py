"""FineMoE (§4): fine-grained expert offloading guided by searched expert maps.

Per iteration:
1. `begin_iteration`: each request's semantic embedding is matched against the Expert Map
   Store (eq. 4); the best map's layers 0..d-1 guide the first d layers (§4.2.1).
2. `observe_layer(l)`: the request's gate distribution at layer l joins its trajectory;
   the trajectory of layers 0..l is matched against the stored maps' same layers (eq. 5),
   and the best map's layer l + d is planned (§4.2.2). The hybrid switch is in
   `search_schedule`. This step and step 3's plan run in one kernel call where the kernels
   build (`elasticmoe.kernels.finemoe_search`: ~30 us per layer against ~90 in NumPy on the
   forward thread), and so does step 1's plan of the first d layers (~5 us against ~100), else
   in NumPy; both decide alike (tests/unit/test_finemoe_search_kernel.py).
3. Each planned layer takes, per request, the minimum expert set of its searched
   distribution under the threshold `delta = Clip(1 - score, 0, 1)` (eqs. 6-8); the plan
   orders them by `p / (l - l_now)` (§4.5). Eq. 8's floor of K experts is for one token; a
   request feeding T > 1 tokens (a prefill) plans at least the expected size of the union of
   its tokens' top-K (`selection.iteration_floor`, ours: the paper does not say).
4. Victims go by `1 / (p * freq)` (§4.5), `p` from the maps searched for the iteration
   (the semantic match for all layers, replaced from layer l + d on by each trajectory
   match), `freq` the cache's visit count (`CacheState.num_uses`); picked in one kernel call
   where the kernels build (~15 NumPy operations after every layer's plan otherwise).
5. `end_iteration`: each request's map {P_0..P_{L-1}} and embedding are stored; the store
   deduplicates by RDY once full (§4.4). RDY weighs the semantic and the whole-map trajectory
   similarity against every stored map, which the iteration's own searches computed (eq. 4 at
   its start, eq. 5's running sums after its last layer) against the same store: a full store
   takes them from there instead of reading its records again (~250 us per decode step at
   C = 1,000 on the small model). Likewise a full store's iterations restart the last one's
   search and kernel binding in place while the batch size holds.

In a batch each request is searched on its own (eqs. 4-5 are [B, C]); an expert planned
for several requests keeps its largest probability, and `p` for eviction is the largest
over the batch's searched maps: the expert is needed if any request needs it.

With an empty store (the first iteration online, §6.3) nothing is planned and eviction
falls back to visit counts (LFU), which is what `1 / (p * freq)` does with `p` equal.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Collection, Sequence

import numpy as np
import torch

from elasticmoe.kernels import finemoe_search
from elasticmoe.offload.cache_state import CacheState, ExpertKey
from elasticmoe.offload.map_store import ExpertMapStore, KernelPlanner, SearchedScores, TrajectorySearch
from elasticmoe.offload.policy import PolicyConfig, PrefetchPlan, RequestContext
from elasticmoe.offload.ranking import PlanMaker, pick_victims
from elasticmoe.offload.routing_map import request_layer_probs
from elasticmoe.offload.search_schedule import trajectory_target
from elasticmoe.offload.selection import (
    PROB_FLOOR,
    eviction_priority,
    minimum_expert_sets,
    selection_threshold,
)


class SearchLog:
    """Similarity scores of the searches made (the paper's Fig. 16a reports their means): the means
    over every search, and the most recent `keep` scores of each kind. Bounded: a serving engine
    searches once per MoE layer and request of every iteration, for as long as it runs (a list of
    every score grew by ~0.3 KB per output token, gigabytes a day)."""

    KEEP = 1024

    def __init__(self, keep: int = KEEP) -> None:
        self.semantic: deque[float] = deque(maxlen=keep)
        self.trajectory: deque[float] = deque(maxlen=keep)
        self._sums = {"semantic": 0.0, "trajectory": 0.0}
        self._counts = {"semantic": 0, "trajectory": 0}

    def add_semantic(self, scores: np.ndarray) -> None:
        self._add("semantic", self.semantic, scores)

    def add_trajectory(self, scores: np.ndarray) -> None:
        self._add("trajectory", self.trajectory, scores)

    def _add(self, kind: str, recent: deque[float], scores: np.ndarray) -> None:
        values = scores.tolist()
        recent.extend(values)
        self._sums[kind] += sum(values)
        self._counts[kind] += len(values)

    def summary(self) -> dict[str, float | None]:
        def mean(kind: str) -> float | None:
            return self._sums[kind] / self._counts[kind] if self._counts[kind] else None

        return {"mean_semantic_score": mean("semantic"), "mean_trajectory_score": mean("trajectory"),
                "num_semantic_searches": self._counts["semantic"],
                "num_trajectory_searches": self._counts["trajectory"]}


class FineMoEPolicy:
    """`OffloadPolicy` of FineMoE; owns its Expert Map Store."""

    name = "finemoe"
    needs_next_layer_gate = False
    observes_layers = True

    def __init__(self, config: PolicyConfig) -> None:
        self.config = config
        shape = (config.num_layers, config.num_experts)
        self.store = ExpertMapStore(config.store_capacity, config.num_layers, config.num_experts,
                                    config.prefetch_distance)
        self.search_log = SearchLog()
        self._requests: list[RequestContext] = []
        self._embeddings = np.zeros((0, 0), dtype=np.float32)  # [B, h] this iteration's, per request
        self._num_tokens = np.zeros(0, dtype=np.int32)  # per request, this iteration
        self._one_token_each = False  # a decode iteration: each request's P_l is its token's distribution
        self._observed = np.zeros((0, *shape), dtype=np.float32)  # [B, L, E] this iteration's P_l per request
        self._current_layer = -1  # the last layer observed
        # The trajectory search, layer by layer, and its kernel form where built (None while the store
        # is empty). Each iteration restarts the last one's in place while the batch size and the
        # store's size hold (a full store in steady traffic): binding the kernel checks a dozen arrays.
        self._trajectory: TrajectorySearch | None = None
        self._planner: KernelPlanner | None = None
        self._semantic_scores: np.ndarray | None = None  # [B, C] eq. 4 of this iteration, for RDY at its end
        self._planned = np.zeros(shape, dtype=np.bool_)
        self._planned_probs = np.zeros(shape, dtype=np.float64)
        self._plans = PlanMaker(self._planned, self._planned_probs)  # reads both in place
        self._guide = np.zeros(shape, dtype=np.float64)  # p_{l,j} of the searched maps, for eviction (in place)
        self._victims = finemoe_search.victim_picker(self._guide, PROB_FLOOR)  # None: NumPy's `pick_victims`

    def begin_iteration(self, requests: Sequence[RequestContext]) -> None:
        if not requests:
            raise ValueError("begin_iteration: an iteration needs at least one request")
        cfg = self.config
        batch = len(requests)
        self._requests = list(requests)
        self._embeddings = np.stack([r.embedding.float().numpy() for r in requests])
        num_tokens = [r.num_tokens for r in requests]
        self._one_token_each = max(num_tokens) == 1
        if batch != len(self._observed):  # else the same buffers: the kernel's binding holds their addresses
            self._observed = np.zeros((batch, cfg.num_layers, cfg.num_experts), dtype=np.float32)
            self._num_tokens = np.zeros(batch, dtype=np.int32)
            self._trajectory = self._planner = None  # bound to the old buffers
        self._num_tokens[:] = num_tokens
        self._current_layer = -1
        self._planned[:] = False
        self._planned_probs[:] = 0.0
        self._semantic_scores = None
        if len(self.store) == 0:
            return
        if self._trajectory is None or not self._trajectory.restart(batch):
            self._trajectory = self.store.trajectory_search(batch)
            self._planner = self._trajectory.planner(self._observed, cfg.top_k, self._num_tokens, self._planned,
                                                     self._planned_probs, self._guide)
        self._semantic_scores, index, scores = self.store.match_semantic(self._embeddings)
        self.search_log.add_semantic(scores)
        first_layers = range(min(cfg.prefetch_distance, cfg.num_layers))
        if self._planner is not None:  # the kernel plans and sets the guide from layer 0 on
            for layer in first_layers:
                self._planner.plan_matches(layer, index, scores)
            return
        maps = self._trajectory.layers_from(index, 0)  # [L, B, E]
        self._guide[:] = maps.max(axis=1)
        for layer in first_layers:
            self._plan_layer(layer, maps[layer], scores)

    def observe_layer(self, layer: int, gate_probs: torch.Tensor, topk_ids: torch.Tensor,
                      next_gate_probs: torch.Tensor | None = None) -> None:
        if layer != self._current_layer + 1:
            raise ValueError(f"observe_layer: expected layer {self._current_layer + 1}, got {layer}")
        decode = self._one_token_each and gate_probs.shape[0] == len(self._requests)  # P_l is the token's
        # A decode step's rows as they are: the kernel copies them itself (one call per layer)
        rows = (gate_probs if self._planner is not None and decode and gate_probs.dtype == torch.float32
                and gate_probs.is_contiguous() else None)
        if rows is None and decode:
            self._observed[:, layer] = gate_probs.float().numpy()
        elif rows is None:
            self._observed[:, layer] = request_layer_probs(gate_probs, self._num_tokens.tolist()).numpy()
        self._current_layer = layer
        if self._trajectory is None:
            return
        target = trajectory_target(layer, self.config.prefetch_distance, self.config.num_layers)
        if self._planner is not None:  # the kernel does all of the below in one call (and marks the matches)
            self.search_log.add_trajectory(self._planner.observe(target, rows)[1])
            return
        self._trajectory.add(self._observed[:, layer])
        if target is None:
            return
        index, best = self._trajectory.best()
        self.store.mark_matched(index)
        self.search_log.add_trajectory(best)
        maps = self._trajectory.layers_from(index, target)  # [L - target, B, E]
        self._plan_layer(target, maps[0], best)
        self._guide[target:] = maps.max(axis=1)

    def prefetch_plan(self, cache: CacheState) -> PrefetchPlan:
        return self._plans.plan(self._current_layer, cache)

    def choose_victims(self, cache: CacheState, num_victims: int, protected: Collection[ExpertKey],
                       for_layers: Sequence[int] = ()) -> list[ExpertKey]:
        if self._victims is not None:
            return self._victims.pick(cache.resident, cache.last_used, cache.num_uses, num_victims, protected)
        return pick_victims(cache, eviction_priority(self._guide, cache.num_uses), num_victims, protected)

    def end_iteration(self, finished_request_ids: Collection[str] = ()) -> None:
        # Only complete maps are stored: an iteration cut short has no trajectory to offer.
        if self._current_layer == self.config.num_layers - 1:  # the maps are distributions by construction
            self.store.insert_many(self._embeddings, self._observed, self._searched_scores())
        self._requests = []
        self._semantic_scores = None  # the iteration is over (its search is kept for the next to restart)
        self._current_layer = -1
        self._planned[:] = False  # nothing to prefetch until the next iteration's search

    def _searched_scores(self) -> SearchedScores | None:
        """This iteration's searches' scores against the store, for RDY when its maps are stored:
        known when the store was full (a store with room appends) and its trajectory search saw
        every layer. Equal to what the store would compute (up to float32 summation order)."""
        search = self._trajectory
        if self._semantic_scores is None or search is None or not search.complete or search.size != self.store.capacity:
            return None
        return search.searched(self._semantic_scores)

    def _plan_layer(self, layer: int, probs: np.ndarray, scores: np.ndarray) -> None:
        """Plan `layer` from each request's searched distribution `probs` [B, E] and its
        similarity `scores` [B] (eqs. 6-8, the floor per request's tokens): the union of the
        requests' minimum expert sets, each expert with its largest probability among the
        requests that need it."""
        order, counts = minimum_expert_sets(probs, selection_threshold(scores), self.config.top_k, self._num_tokens)
        chosen_rows, ranks = np.nonzero(np.arange(probs.shape[1]) < counts[:, None])
        experts = order[chosen_rows, ranks]
        mass = np.zeros(probs.shape, dtype=np.float64)
        mass[chosen_rows, experts] = probs[chosen_rows, experts]
        self._planned[layer, experts] = True
        np.maximum(self._planned_probs[layer], mass.max(axis=0), out=self._planned_probs[layer])
