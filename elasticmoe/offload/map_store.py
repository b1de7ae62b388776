"""FineMoE's Expert Map Store (§4.4): at most C iteration records, deduplicated by the
redundancy score RDY, searched by semantic (eq. 4) and trajectory (eq. 5) similarity.

Records live in preallocated NumPy arrays (the paper keeps ndarrays and converts them to
tensors to search, §5; searching here stays in NumPy, see `ExpertMapStore`); slot i is valid for
i < len. Searching runs once per layer of every iteration, so the store keeps what the cosine
needs ready: maps layer-major [L, C, E] (the first n layers of every map are one contiguous
block), the same maps as [L, E, C] for the search kernel's dot products, and, per record, the
norm of its first n layers for every n [L, C] and its embedding's norm [C]. The scores equal
`similarity.semantic_scores` / `trajectory_scores` / `redundancy_scores` (tested).

Deduplication (§4.4): while the store has room a new record is appended. Once it holds C
records, a new iteration x replaces the stored iteration y with the highest `RDY_{x,y}`,
the one it is most redundant with ("we update the old iterations y with new iterations
x"). New records are inserted one at a time against the store as it stands, so two
near-identical new iterations of one batch replace each other rather than two old ones.

Stale records go too (ours: the paper does not age the store). A record that has not been the
best match of any search for more than C insertions gains `staleness = age / C - 1` (age: the
insertions since it was stored or last matched) on its redundancy when a new record looks for
one to replace. While traffic holds still the records in use are matched and the rule is RDY's;
after a change of traffic the past's maps stop matching and leave within ~2C insertions. Without
it the store kept them: RDY replaces the stored map most like the new one, which after the
first few is another new map (docs/offload.md, "Visit counts age").

Equal scores (identical embeddings: every iteration of a request presents its prompt's
embedding) go to the most recently stored record: the latest iteration of the same
request is the best guess of the next one. The paper does not say; this is our choice.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import numpy as np
import numpy.typing as npt
import torch

from elasticmoe.kernels import finemoe_search
from elasticmoe.offload.routing_map import RoutingMapRecord

_EPS = 1e-12  # as in `similarity`: a zero vector has cosine 0 with everything


def latest_best(scores: npt.NDArray[np.float32], stamps: npt.NDArray[np.int64]
                ) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.float32]]:
    """Per row of `scores` [B, C] the best stored record: (index [B], score [B]); equal scores go
    to the record with the highest insertion stamp `stamps` [C] (see the module docstring)."""
    best = scores.max(axis=1)
    return np.where(scores == best[:, None], stamps, -1).argmax(axis=1), best


def _norms(rows: npt.NDArray[np.float32]) -> npt.NDArray[np.float32]:
    """The Euclidean norm of each row of `rows` [B, n]: [B]."""
    return np.sqrt(np.einsum("bx,bx->b", rows, rows))


def _cosine(dots: npt.NDArray[np.float32], new_norms: npt.ArrayLike, old_norms: npt.ArrayLike
            ) -> npt.NDArray[np.float32]:
    """Cosines from dot products and both sides' norms, each floored at `_EPS` (a zero vector has
    cosine 0 with everything)."""
    return dots / (np.maximum(new_norms, _EPS) * np.maximum(old_norms, _EPS))


class ExpertMapStore:
    """Iteration records of a model with `num_layers` MoE layers of `num_experts` experts.

    The arrays are NumPy (float32): the store is searched per MoE layer of every step on a few
    thousand values, where torch's per-op dispatch costs more than the arithmetic. The public
    methods take and return tensors."""

    def __init__(self, capacity: int, num_layers: int, num_experts: int, prefetch_distance: int) -> None:
        if capacity < 1:
            raise ValueError(f"expert map store: capacity must be >= 1, got {capacity}")
        if not 0 <= prefetch_distance <= num_layers:
            raise ValueError(f"expert map store: prefetch distance {prefetch_distance} outside [0, {num_layers}]")
        self.capacity = capacity
        self.num_layers, self.num_experts = num_layers, num_experts
        self.prefetch_distance = prefetch_distance
        self._maps = np.zeros((num_layers, capacity, num_experts), dtype=np.float32)  # layer-major
        # [L, E, C]: the same maps with the records contiguous, which the search kernel's dot
        # products read (a vector of records per expert instead of a horizontal sum per record)
        self._columns = np.zeros((num_layers, num_experts, capacity), dtype=np.float32)
        # [L, C]: the norm of each record's first l + 1 layers as one vector (eq. 5's |map| on them)
        self._trajectory_norms = np.zeros((num_layers, capacity), dtype=np.float32)
        self._embeddings: np.ndarray | None = None  # [C, h], sized by the first record
        self._embedding_norms = np.zeros(capacity, dtype=np.float32)
        self._stamps = np.zeros(capacity, dtype=np.int64)  # insertion order, for ties
        self._last_matched = np.zeros(capacity, dtype=np.int64)  # `_num_added` when last stored or best matched
        self._num_added = 0
        self._size = 0
        self.num_replaced = 0  # records dropped as redundant
        self._bound_placer: finemoe_search.StorePlacer | Literal[False] | None = None  # False: no kernel

    def __len__(self) -> int:
        return self._size

    @property
    def maps(self) -> torch.Tensor:
        """[len, L, E] (a copy)."""
        return torch.from_numpy(self._maps[:, : self._size].transpose(1, 0, 2).copy())

    def layer_probs(self, index: torch.Tensor, layer: int) -> torch.Tensor:
        """Layer `layer` of the stored maps `index` [B] -> [B, E]."""
        return torch.from_numpy(self._maps[layer, index.numpy()])

    def layers_from(self, index: torch.Tensor, layer: int) -> torch.Tensor:
        """Layers `layer`..L-1 of the stored maps `index` [B] -> [L - layer, B, E]."""
        return torch.from_numpy(self._maps[layer:, index.numpy()])

    @property
    def embeddings(self) -> torch.Tensor:
        """[len, h] (a view: do not write)."""
        if self._embeddings is None:
            return torch.zeros(0, 0)
        return torch.from_numpy(self._embeddings[: self._size])

    def add(self, record: RoutingMapRecord) -> int:
        """Store `record`; returns the slot it took (replacing the most redundant record when full)."""
        return self.insert(record.embedding.float().numpy(), record.probs.float().numpy())

    def insert(self, embedding: npt.NDArray[np.float32], probs: npt.NDArray[np.float32]) -> int:
        """`add` for a map already known to be one (a policy's own observed distributions):
        `embedding` [h] and `probs` [L, E], float32."""
        return self.insert_many(embedding[None], probs[None])[0]

    def insert_many(self, embeddings: npt.NDArray[np.float32], maps: npt.NDArray[np.float32],
                    searched: SearchedScores | None = None) -> list[int]:
        """`insert` of each record (`embeddings` [B, h], `maps` [B, L, E]) in order; returns their
        slots. A full store compares each new record with every stored one (RDY: [h] and [L * E]
        dot products with C records); here those of a batch are one matrix product against the
        store as it stands, and each record placed updates only the later records' column of its
        slot. One at a time they cost ~0.12 ms each at C = 1,000 (~8 ms per decode step of 64
        requests). The slots chosen are the sequential inserts' (tested).

        `searched`: the records' semantic and whole-map trajectory scores against the store as it
        stands, from the iteration's own searches (`SearchedScores`): a full store then needs no
        pass over its records (each pass reads the embeddings and maps, ~3 MB at C = 1,000 on the
        small model, which the forward has just pushed out of the caches: ~250 us per decode step).

        A full store places the records in one kernel call where the kernels build
        (`finemoe_search.StorePlacer`, the same slots as the loop below: tested), ~15 NumPy
        operations per record otherwise."""
        if maps.ndim != 3 or maps.shape[1:] != (self.num_layers, self.num_experts):
            raise ValueError(f"expert map store: map must be [{self.num_layers}, {self.num_experts}], "
                             f"got {tuple(maps.shape[1:])}")
        if self._embeddings is None:
            self._embeddings = np.zeros((self.capacity, embeddings.shape[1]), dtype=np.float32)
        if embeddings.ndim != 2 or embeddings.shape[1] != self._embeddings.shape[1]:
            raise ValueError(f"expert map store: embedding must have {self._embeddings.shape[1]} values, "
                             f"got {embeddings.shape[1:]}")
        if len(embeddings) != len(maps):
            raise ValueError(f"expert map store: {len(embeddings)} embeddings for {len(maps)} maps")
        slots = []
        num_appended = min(len(maps), self.capacity - self._size)
        for i in range(num_appended):  # a store with room appends
            slots.append(self._size)
            self._size += 1
            self._write(slots[-1], embeddings[i], maps[i])
        if num_appended == len(maps):
            return slots
        # The rest replace records, one at a time, by their RDY [B', C] against the store as it stands
        embeddings, maps = embeddings[num_appended:], maps[num_appended:]
        flat = maps.reshape(len(maps), -1)  # [B', L * E]: eq. 5 over every layer
        searched = None if num_appended else searched  # the searches were against the store before the appends
        if searched is not None:
            searched.check_against(self)
        redundancy = None if searched is not None else self._redundancy(embeddings, maps)
        placer = self._placer()
        if placer is not None:
            placed, self._num_added = placer.place(
                np.ascontiguousarray(embeddings, dtype=np.float32), np.ascontiguousarray(flat, dtype=np.float32),
                redundancy,
                None if searched is None else (searched.semantic, searched.dots, searched.new_sq, searched.norms),
                self.prefetch_distance / self.num_layers, self._num_added)
            self.num_replaced += len(placed)
            return slots + placed
        if redundancy is None:
            assert searched is not None  # and checked against this store above
            redundancy = self._rdy(searched.semantic, searched.trajectory)
        embedding_norms, map_norms = _norms(embeddings), _norms(flat)
        for i, (embedding, probs) in enumerate(zip(embeddings, maps, strict=True)):
            self.num_replaced += 1
            slot = int(self._best(redundancy[i : i + 1] + self._staleness())[0][0])
            self._write(slot, embedding, probs)
            slots.append(slot)
            if i + 1 < len(embeddings):  # the later records now meet this one there
                later = slice(i + 1, None)
                redundancy[later, slot] = self._rdy(
                    _cosine(embeddings[later] @ embedding, embedding_norms[later], self._embedding_norms[slot]),
                    _cosine(flat[later] @ flat[i], map_norms[later], self._trajectory_norms[-1, slot]))
        return slots

    def _placer(self) -> finemoe_search.StorePlacer | None:
        """The placement kernel bound to this store's arrays (once), or None where it is not built."""
        if self._bound_placer is None:
            assert self._embeddings is not None
            self._bound_placer = finemoe_search.store_placer(
                self._embeddings, self._embedding_norms, self._maps, self._columns, self._trajectory_norms,
                self._stamps, self._last_matched) or False
        return self._bound_placer or None

    def _write(self, slot: int, embedding: npt.NDArray[np.float32], probs: npt.NDArray[np.float32]) -> None:
        assert self._embeddings is not None
        self._embeddings[slot] = embedding
        self._embedding_norms[slot] = np.sqrt(np.dot(embedding, embedding))
        self._maps[:, slot] = probs
        self._columns[:, :, slot] = probs
        self._trajectory_norms[:, slot] = np.sqrt(np.cumsum(np.einsum("le,le->l", probs, probs)))
        self._stamps[slot] = self._last_matched[slot] = self._num_added
        self._num_added += 1

    def mark_matched(self, index: npt.NDArray[np.int64]) -> None:
        """Records `index` were the best matches of a search whose plan is used: they are in use."""
        self._last_matched[index] = self._num_added

    def _staleness(self) -> npt.NDArray[np.float32]:
        """[C] `max(0, age / C - 1)` per record (see the module docstring)."""
        age = self._num_added - self._last_matched[: self._size]
        return np.maximum(age / self.capacity - 1.0, 0.0).astype(np.float32)

    def semantic_scores(self, embeddings: npt.NDArray[np.float32]) -> npt.NDArray[np.float32]:
        """Eq. 4's cosine of `embeddings` [B, h] with every stored record's: [B, len]. Needs a
        non-empty store."""
        self._check_searchable()
        return self._semantic(embeddings)

    def match_semantic(self, embeddings: npt.NDArray[np.float32]
                       ) -> tuple[npt.NDArray[np.float32], npt.NDArray[np.int64], npt.NDArray[np.float32]]:
        """Eq. 4 for `embeddings` [B, h] (float32): the scores [B, len], and per row the best stored
        record (index [B], score [B]; ties to the most recently stored record), marked as in use
        (`mark_matched`). After the matrix product, one kernel call where the kernels build. Needs a
        non-empty store."""
        self._check_searchable()
        size = self._size
        queries = np.ascontiguousarray(embeddings, dtype=np.float32)
        dots = self._semantic_dots(queries)
        found = finemoe_search.semantic_best(dots, queries, self._embedding_norms[:size], self._stamps[:size],
                                             self._last_matched, self._num_added)
        if found is not None:
            return dots, *found
        scores = self._semantic(queries, dots)
        index, best = self._best(scores)
        self.mark_matched(index)
        return scores, index, best

    def best_of(self, scores: npt.NDArray[np.float32]) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.float32]]:
        """The best stored record per row of `scores` [B, len]: (index [B], score [B]), ties to the
        most recently stored record."""
        return self._best(scores)

    def search_semantic(self, embeddings: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Eq. 4 for `embeddings` [B, h]: per row the most similar stored iteration (index [B],
        score [B]). Needs a non-empty store."""
        index, score = self.best_semantic(embeddings.float().numpy())
        return torch.from_numpy(index), torch.from_numpy(score)

    def best_semantic(self, embeddings: npt.NDArray[np.float32]
                      ) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.float32]]:
        """`search_semantic` on arrays."""
        return self._best(self.semantic_scores(embeddings))

    def search_trajectory(self, trajectories: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Eq. 5 for observed `trajectories` [B, n, E] (the first n layers of B iterations)
        against the first n layers of every stored map: (index [B], score [B])."""
        self._check_searchable()
        n = trajectories.shape[1]
        if not 1 <= n <= self.num_layers or trajectories.dim() != 3 or trajectories.shape[2] != self.num_experts:
            raise ValueError(f"trajectory search: need [B, 1..{self.num_layers}, {self.num_experts}], "
                             f"got {tuple(trajectories.shape)}")
        index, score = self._best(self._trajectory(trajectories.float().numpy(), n))
        return torch.from_numpy(index), torch.from_numpy(score)

    def trajectory_search(self, batch: int) -> TrajectorySearch:
        """Eq. 5 layer by layer for `batch` iterations under way (see `TrajectorySearch`), valid
        while the store does not change (FineMoE adds records between iterations)."""
        self._check_searchable()
        return TrajectorySearch(self, batch)

    def _best(self, scores: npt.NDArray[np.float32]) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.float32]]:
        """`best_matches`, ties to the most recently stored record (`latest_best`)."""
        return latest_best(scores, self._stamps[: self._size])

    def _semantic(self, embeddings: npt.NDArray[np.float32],
                  dots: npt.NDArray[np.float32] | None = None) -> npt.NDArray[np.float32]:
        """Eq. 4's cosine of `embeddings` [B, h] with every stored record's: [B, C]; `dots`: their
        dot products, if already computed (`_semantic_dots`)."""
        if dots is None:
            dots = self._semantic_dots(embeddings)
        return _cosine(dots, _norms(embeddings)[:, None], self._embedding_norms[: self._size])

    def _semantic_dots(self, embeddings: npt.NDArray[np.float32]) -> npt.NDArray[np.float32]:
        """`embeddings` [B, h] times every stored record's embedding: [B, C] (one BLAS product)."""
        assert self._embeddings is not None
        return embeddings @ self._embeddings[: self._size].T

    def _trajectory(self, trajectories: npt.NDArray[np.float32], n: int) -> npt.NDArray[np.float32]:
        """Eq. 5's cosine of `trajectories` [B, n, E] with the first n layers of every stored map:
        [B, C]. The flattened dot product is a sum of per-layer products ([B, E] x [E, C], BLAS
        each), without copying the layer-major maps."""
        maps = self._maps[:, : self._size]
        dots = trajectories[:, 0] @ maps[0].T
        for layer in range(1, n):
            dots += trajectories[:, layer] @ maps[layer].T
        new_norms = _norms(trajectories.reshape(trajectories.shape[0], -1))[:, None]
        return _cosine(dots, new_norms, self._trajectory_norms[n - 1, : self._size])

    def _redundancy(self, embeddings: npt.NDArray[np.float32], maps: npt.NDArray[np.float32]
                    ) -> npt.NDArray[np.float32]:
        """§4.4 RDY [B, C] of new records (`embeddings` [B, h], `maps` [B, L, E]) against every
        stored one."""
        return self._rdy(self._semantic(embeddings), self._trajectory(maps, self.num_layers))

    def _rdy(self, semantic: npt.NDArray[np.float32], trajectory: npt.NDArray[np.float32]) -> npt.NDArray[np.float32]:
        """§4.4: RDY from the semantic and the whole-map trajectory similarity, weighted by the
        layers each search guides (d of L semantic)."""
        w_sem = self.prefetch_distance / self.num_layers
        return w_sem * semantic + (1.0 - w_sem) * trajectory

    def _check_searchable(self) -> None:
        if self._size == 0:
            raise ValueError("expert map store: nothing to search yet (the store is empty)")


@dataclass(frozen=True, slots=True, eq=False)
class SearchedScores:
    """An iteration's searches against the store's C records: eq. 4's scores [B, C] (`semantic`)
    and eq. 5 over every layer as the trajectory search's sums: dot products [B, C] (`dots`), the
    iteration's squared norms [B] (`new_sq`) and the stored maps' norms floored at eps [C]
    (`norms`). What §4.4's RDY of the iteration's maps needs when they are stored at its end, if
    the store has not changed since. The arrays may be the search's own buffers: use it before the
    search restarts."""

    semantic: npt.NDArray[np.float32]
    dots: npt.NDArray[np.float32]
    new_sq: npt.NDArray[np.float32]
    norms: npt.NDArray[np.float32]

    @property
    def trajectory(self) -> npt.NDArray[np.float32]:
        """Eq. 5's cosines [B, C] over every layer."""
        return _trajectory_cosines(self.dots, self.new_sq, self.norms)

    def check_against(self, store: ExpertMapStore) -> None:
        """Refuse scores of a store that has changed since the searches."""
        size = self.semantic.shape[1]
        if len(store) != size:
            raise RuntimeError(f"searched scores: of a store of {size} records, it now holds {len(store)}")


def _trajectory_cosines(dots: npt.NDArray[np.float32], new_sq: npt.NDArray[np.float32],
                        norms: npt.NDArray[np.float32]) -> npt.NDArray[np.float32]:
    """Eq. 5's cosines [B, C] from the trajectory search's sums: dot products [B, C], the
    iteration's squared norms [B] and the stored maps' norms floored at eps [C]."""
    return _cosine(dots, np.sqrt(new_sq)[:, None], norms)


class TrajectorySearch:
    """`ExpertMapStore.search_trajectory` for an iteration whose layers arrive one at a time.

    The trajectory score of the first n layers is a cosine of n*E-vectors: its dot product and
    squared norms are sums over layers. Keeping those sums, the search after layer n costs one
    [B, E] x [E, C] product instead of n of them. It runs after every MoE layer of every
    iteration on the forward thread, so it works in NumPy on views of the store's tensors: on
    a few thousand values torch's per-op dispatch costs more than the arithmetic (one iteration
    of the policy on the trained small model: 760 us with torch, 490 us so). Scores and ties
    equal `search_trajectory`'s on the same n layers (tested)."""

    def __init__(self, store: ExpertMapStore, batch: int) -> None:
        self.store = store
        self.size = len(store)
        self._maps = store._maps[:, : self.size]  # [L, C, E] views, no copies
        self._columns = store._columns[:, :, : self.size]  # [L, E, C]
        self._norms = np.empty((store.num_layers, self.size), dtype=np.float32)  # [L, C], floored at _EPS
        self._stamps = store._stamps[: self.size]
        self.dots = np.empty((batch, self.size), dtype=np.float32)
        self.new_sq = np.empty(batch, dtype=np.float32)
        self._start()

    def add(self, probs: npt.ArrayLike) -> None:
        """The next layer's gate distributions `probs` [B, E] of the B iterations."""
        self._check_a_layer_is_left()
        p = np.asarray(probs, dtype=np.float32)
        self.dots += p @ self._maps[self.num_layers].T
        self.new_sq += np.einsum("be,be->b", p, p)
        self.num_layers += 1

    def planner(self, observed: npt.NDArray[np.float32], top_k: int, num_tokens: npt.NDArray[np.int32],
                planned: npt.NDArray[np.bool_], planned_probs: npt.NDArray[np.float64], guide: npt.NDArray[np.float64]
                ) -> KernelPlanner | None:
        """This search's layer steps and FineMoE's plans in kernel calls over `observed` [B, L, E] and
        the plan arrays (see `KernelPlanner`); None where the kernel is not available (the caller
        runs `add`, `best` and the NumPy plan)."""
        step = finemoe_search.bind(self._maps, self._columns, self._norms, self._stamps, observed, self.dots, self.new_sq, planned,
                                   planned_probs, guide, top_k, num_tokens, self.store._last_matched)
        return None if step is None else KernelPlanner(self, step)

    def best(self) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.float32]]:
        """(index [B], score [B]) of the best match on the layers added so far; ties go to the
        most recently stored record (as `ExpertMapStore` breaks them)."""
        return latest_best(self.scores(), self._stamps)

    def scores(self) -> npt.NDArray[np.float32]:
        """Eq. 5's cosines [B, C] on the layers added so far (on every layer: RDY's trajectory part)."""
        if self.num_layers == 0:
            raise ValueError("trajectory search: no layer observed yet")
        self._check_store_unchanged()
        return _trajectory_cosines(self.dots, self.new_sq, self._norms[self.num_layers - 1])

    def searched(self, semantic: npt.NDArray[np.float32]) -> SearchedScores:
        """The iteration's searches for RDY (`SearchedScores`): eq. 4's `semantic` [B, C] and this
        search over every layer. Its buffers, not copies: valid until `restart`."""
        if not self.complete:
            raise ValueError(f"trajectory search: {self.num_layers} of {self.store.num_layers} layers observed")
        self._check_store_unchanged()
        return SearchedScores(semantic, self.dots, self.new_sq, self._norms[-1])

    @property
    def complete(self) -> bool:
        """Every layer has been added."""
        return self.num_layers == self.store.num_layers

    def restart(self, batch: int) -> bool:
        """Begin a new iteration's search of `batch` iterations in the same buffers (the kernel's
        binding stays valid) if the store still holds as many records and the batch is as large;
        the stored norms are read again (records may have been replaced). False: make a new search."""
        if len(self.store) != self.size or self.dots.shape[0] != batch:
            return False
        self._start()
        return True

    def _start(self) -> None:
        """No layer added yet; the stored records' norms as they are now."""
        np.maximum(self.store._trajectory_norms[:, : self.size], _EPS, out=self._norms)
        self.dots.fill(0.0)
        self.new_sq.fill(0.0)
        self.num_layers = 0

    def _check_a_layer_is_left(self) -> None:
        if self.num_layers >= self.store.num_layers:
            raise ValueError(f"trajectory search: the model has {self.store.num_layers} layers")

    def _check_store_unchanged(self) -> None:
        if len(self.store) != self.size:
            raise RuntimeError("trajectory search: the store changed during the search")

    def layers_from(self, index: npt.NDArray[np.int64], layer: int) -> npt.NDArray[np.float32]:
        """Layers `layer`..L-1 of the stored maps `index` [B] -> [L - layer, B, E] (a copy)."""
        return self._maps[layer:, index]


class KernelPlanner:
    """A `TrajectorySearch` whose steps run in the kernel (`elasticmoe.kernels.finemoe_search`),
    with FineMoE's plan (`FineMoEPolicy._plan_layer` into `planned`/`planned_probs` [L, E], the
    matched maps' layers from the planned one on into `guide` [L, E]) in the same call."""

    def __init__(self, search: TrajectorySearch, step: finemoe_search.LayerStep) -> None:
        self.search = search
        self.step = step

    def observe(self, target: int | None, probs: torch.Tensor | None = None
                ) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.float32]]:
        """`add` the next layer of `observed` and, for a `target` layer (None: none), `best()`, the
        plan of that layer from the matches and the store's `mark_matched` of them; returns the
        matches (index [B], score [B], empty without a target; views, valid until the next call).
        `probs` (contiguous float32 [B, E]): the layer's rows, which the kernel copies into
        `observed` itself (None: `observed` holds them)."""
        self.search._check_a_layer_is_left()
        self.search._check_store_unchanged()
        if probs is not None and (probs.dtype != torch.float32 or not probs.is_contiguous()
                                  or tuple(probs.shape) != (self.step.batch, self.step.num_experts)):
            raise ValueError(f"kernel planner: probs must be contiguous float32 [{self.step.batch}, "
                             f"{self.step.num_experts}], got {probs.dtype} {tuple(probs.shape)}")
        matches = self.step(self.search.num_layers, target, 0 if probs is None else probs.data_ptr(),
                            self.search.store._num_added)
        self.search.num_layers += 1
        return matches

    def plan_matches(self, target: int, index: npt.NDArray[np.int64], score: npt.NDArray[np.float32]) -> None:
        """The plan of layer `target` from matches found elsewhere (the semantic search)."""
        self.search._check_store_unchanged()
        self.step.plan(target, index, score)
