"""FineMoE's per-layer search and plan in one kernel call (csrc/finemoe_search.cpp).

`FineMoEPolicy.observe_layer` runs after every MoE layer's router on the forward thread; its NumPy
form is ~25 small array operations whose dispatch costs far more than their arithmetic. The kernel
does the same steps (see its header for the precision it keeps), and plans the iteration's first
layers from the semantic search's matches the same way. `bind` checks the arrays of one iteration
once and returns the calls (None where the kernel is not available: the caller runs the NumPy
reference); each call then passes only integers and cached addresses. `victim_picker` binds
FineMoE's eviction order (§4.5) over the policy's guide the same way, `semantic_best` finishes the
semantic search (eq. 4) after its matrix product, and `store_placer` the Expert Map Store's
placement of new records once it is full (§4.4: ~15 NumPy operations per record
otherwise, each starting cold after the forward's kernels; docs/offload.md, "Why the policy's
Python costs five times its own time in the forward").
"""

from __future__ import annotations

import ctypes
from collections.abc import Collection, Sequence
from functools import cache

import numpy as np
import numpy.typing as npt

from elasticmoe.kernels.build import declare, load_kernel


@cache
def _library() -> ctypes.CDLL | None:
    lib = load_kernel("finemoe_search")
    if lib is None:
        return None
    i64, ptr, c_int = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
    lib = declare(lib, {"emoe_finemoe_observe": [ptr, i64, i64, i64, c_int, c_int, ptr, i64, i64, ptr, ptr, ptr, c_int,
                                                 ptr, ptr, c_int, c_int, c_int, ptr, ptr, ptr, ptr, ptr, ptr, ptr, ptr,
                                                 i64],
                        "emoe_finemoe_plan": [ptr, i64, i64, i64, c_int, c_int, c_int, ptr, ptr, c_int, c_int, ptr,
                                              ptr, ptr, ptr],
                        "emoe_finemoe_victims": [ptr, ptr, ptr, ptr, ptr, i64, i64, ctypes.c_double, ptr],
                        "emoe_plan_from_predictions": [ptr, ptr, ptr, c_int, c_int, c_int, ptr, ptr]})
    lib.emoe_finemoe_victims.restype = i64
    lib.emoe_plan_from_predictions.restype = i64
    lib.emoe_finemoe_place.argtypes = [ptr, ptr, ptr, ptr, ptr, ptr, ptr, i64, c_int, c_int, c_int, ptr, ptr, c_int,
                                       ptr, ptr, ptr, ptr, ptr, ctypes.c_double, i64, ptr]
    lib.emoe_finemoe_place.restype = i64
    declare(lib, {"emoe_finemoe_semantic_best": [ptr, ptr, c_int, c_int, ptr, ptr, i64, ptr, ptr, ptr, i64]})
    return lib


def available() -> bool:
    return _library() is not None


# An array handed to a kernel as a raw pointer: (array, dtype, shape) by name.
ArraySpec = tuple[np.ndarray, type, tuple[int, ...]]


def _check_arrays(kernel: str, arrays: dict[str, ArraySpec]) -> None:
    """Refuse an array of another dtype or shape, or not contiguous: the kernel reads it in place."""
    for name, (array, dtype, shape) in arrays.items():
        if array.dtype != dtype or array.shape != shape or not array.flags.c_contiguous:
            raise ValueError(f"finemoe {kernel} kernel: {name} must be contiguous {np.dtype(dtype)} {shape}, "
                             f"got {array.dtype} {array.shape}")


def _check_last_matched(kernel: str, last_matched: npt.NDArray[np.int64], num_records: int) -> None:
    """The store's whole [capacity] stamps, of which the kernel writes the first `num_records`."""
    if (last_matched.dtype != np.int64 or last_matched.ndim != 1 or last_matched.shape[0] < num_records
            or not last_matched.flags.c_contiguous):
        raise ValueError(f"finemoe {kernel} kernel: last_matched must be contiguous int64 [>= {num_records}], "
                         f"got {last_matched.dtype} {last_matched.shape}")


class LayerStep:
    """`step(layer, target)`: layer `layer` of `observed` [B, L, E] joins the trajectory sums
    `dots` [B, C] and `new_sq` [B] (dot products with `columns` [L, E, C], the same maps with the
    records contiguous); with a `target` layer (None: sums only), the best of the `C`
    records of `maps` [L, C, E] (trajectory norms `norms` [L, C], ties by `stamps` [C]) is found and
    layer `target` is planned into `planned`, `planned_probs` and `guide` [L, E] as
    `FineMoEPolicy._plan_layer` does. Returns the matches (index [B], score [B]); empty without a
    target; `num_tokens` [B] are the requests' tokens in the iteration (eq. 8's floor, see
    `selection.iteration_floor`). `step.plan(target, index, score)` plans layer `target` the same
    way from matches found elsewhere (the semantic search, eq. 4). The arrays are used in place:
    they must outlive the step and keep their buffers. With `last_matched` (the store's [C] stamps,
    int64) a step that plans also marks its matches as the store's `mark_matched` does."""

    def __init__(self, lib: ctypes.CDLL, maps: npt.NDArray[np.float32], columns: npt.NDArray[np.float32],
                 norms: npt.NDArray[np.float32],
                 stamps: npt.NDArray[np.int64], observed: npt.NDArray[np.float32], dots: npt.NDArray[np.float32],
                 new_sq: npt.NDArray[np.float32], planned: npt.NDArray[np.bool_],
                 planned_probs: npt.NDArray[np.float64], guide: npt.NDArray[np.float64], top_k: int,
                 num_tokens: npt.NDArray[np.int32], last_matched: npt.NDArray[np.int64] | None = None) -> None:
        num_layers, num_records, num_experts = maps.shape
        batch = observed.shape[0]
        shapes: dict[str, ArraySpec] = {
            "norms": (norms, np.float32, (num_layers, num_records)),
            "stamps": (stamps, np.int64, (num_records,)),
            "observed": (observed, np.float32, (batch, num_layers, num_experts)),
            "dots": (dots, np.float32, (batch, num_records)),
            "new_sq": (new_sq, np.float32, (batch,)),
            "planned": (planned, np.bool_, (num_layers, num_experts)),
            "planned_probs": (planned_probs, np.float64, (num_layers, num_experts)),
            "guide": (guide, np.float64, (num_layers, num_experts)),
            "num_tokens": (num_tokens, np.int32, (batch,)),
        }
        _check_arrays("search", shapes)
        if maps.dtype != np.float32 or maps.strides[2] != 4 or num_records < 1 or batch < 1:
            raise ValueError(f"finemoe search kernel: maps must be float32 [L, C >= 1, E] rows, got {maps.dtype} "
                             f"{maps.shape} strides {maps.strides}")
        if (columns.dtype != np.float32 or columns.shape != (num_layers, num_experts, num_records)
                or columns.strides[2] != 4):
            raise ValueError(f"finemoe search kernel: columns must be float32 [{num_layers}, {num_experts}, "
                             f"{num_records}] with the records contiguous, got {columns.dtype} {columns.shape} "
                             f"strides {columns.strides}")
        if last_matched is not None:
            _check_last_matched("search", last_matched, num_records)
        if (num_tokens < 1).any():
            raise ValueError(f"finemoe search kernel: every request has >= 1 token, got {num_tokens}")
        self._fn = lib.emoe_finemoe_observe
        self._plan_fn = lib.emoe_finemoe_plan
        # kept alive
        self._arrays = (maps, columns, norms, stamps, observed, dots, new_sq, planned, planned_probs, guide, num_tokens,
                        last_matched)
        self._last_matched = 0 if last_matched is None else last_matched.ctypes.data
        self.batch, self.num_experts = batch, num_experts
        self.index = np.zeros(batch, dtype=np.int64)
        self.score = np.zeros(batch, dtype=np.float32)
        address = {name: array.ctypes.data for name, (array, _, _) in shapes.items()}
        self._head = (maps.ctypes.data, maps.strides[0] // 4, maps.strides[1] // 4, num_records, num_layers,
                      num_experts, columns.ctypes.data, columns.strides[0] // 4, columns.strides[1] // 4,
                      address["norms"], address["stamps"], address["observed"], batch, address["dots"],
                      address["new_sq"])
        self._tail = (top_k, address["num_tokens"], address["planned"], address["planned_probs"], address["guide"],
                      self.index.ctypes.data, self.score.ctypes.data)
        # emoe_finemoe_plan: the maps' layout from the head, the plan's arrays from the tail
        self._plan_head = (*self._head[:6], batch, self.index.ctypes.data, self.score.ctypes.data)
        self._plan_tail = self._tail[:5]

    def __call__(self, layer: int, target: int | None, probs: int = 0, num_added: int = 0
                 ) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.float32]]:
        """`probs`: the address of the layer's gate distributions, contiguous float32 [B, E], which
        the kernel copies into `observed` first (0: `observed` holds them); `num_added`: the stamp
        the matches get in `last_matched`. The matches returned are views, valid until the next call."""
        if self._fn(*self._head, layer, -1 if target is None else target, *self._tail, probs, self._last_matched,
                    num_added) != 0:
            raise ValueError(f"finemoe search kernel: layer {layer} or target {target} out of range")
        if target is None:
            return self.index[:0], self.score[:0]
        return self.index, self.score

    def plan(self, target: int, index: npt.ArrayLike, score: npt.ArrayLike) -> None:
        """Plan layer `target` (and the guide from it on) from the records `index` [B] matched with
        similarity `score` [B]."""
        self.index[:] = index
        self.score[:] = score
        if self._plan_fn(*self._plan_head, target, *self._plan_tail) != 0:
            raise ValueError(f"finemoe search kernel: target {target} or records {self.index} out of range")


def bind(maps: npt.NDArray[np.float32], columns: npt.NDArray[np.float32], norms: npt.NDArray[np.float32],
         stamps: npt.NDArray[np.int64], observed: npt.NDArray[np.float32], dots: npt.NDArray[np.float32],
         new_sq: npt.NDArray[np.float32],
         planned: npt.NDArray[np.bool_], planned_probs: npt.NDArray[np.float64], guide: npt.NDArray[np.float64],
         top_k: int, num_tokens: npt.NDArray[np.int32], last_matched: npt.NDArray[np.int64] | None = None
         ) -> LayerStep | None:
    """A `LayerStep` over these arrays, or None where the kernel is not available."""
    lib = _library()
    if lib is None:
        return None
    return LayerStep(lib, maps, columns, norms, stamps, observed, dots, new_sq, planned, planned_probs, guide, top_k,
                     num_tokens, last_matched)


class VictimPicker:
    """`pick(resident, last_used, num_uses, num_victims, protected)`: FineMoE's victims (§4.5) by the
    guide `guide` [L, E] (fp64, used in place: the policy rewrites it each layer) and the cache's
    arrays [L, E] (bool, int64, int64), exactly as `ranking.pick_victims` orders
    `selection.eviction_priority(guide, num_uses)`: one call instead of ~15 NumPy operations after
    every MoE layer's plan."""

    def __init__(self, lib: ctypes.CDLL, guide: npt.NDArray[np.float64], prob_floor: float) -> None:
        if guide.dtype != np.float64 or guide.ndim != 2 or not guide.flags.c_contiguous:
            raise ValueError(f"finemoe victims kernel: guide must be contiguous float64 [L, E], got {guide.dtype} "
                             f"{guide.shape}")
        self._fn = lib.emoe_finemoe_victims
        self._guide = guide  # kept alive
        self._shape = guide.shape
        self._num_experts = guide.shape[1]
        self._protected = np.zeros(guide.shape, dtype=np.uint8)
        self._out = np.zeros(guide.size, dtype=np.int64)
        self._head = (guide.ctypes.data,)
        self._tail = (self._protected.ctypes.data, guide.size)
        self._floor_out = (prob_floor, self._out.ctypes.data)

    def pick(self, resident: npt.NDArray[np.bool_], last_used: npt.NDArray[np.int64],
             num_uses: npt.NDArray[np.int64], num_victims: int, protected: Collection[tuple[int, int]]
             ) -> list[tuple[int, int]]:
        if num_victims <= 0:
            return []
        for array, dtype in ((resident, np.bool_), (last_used, np.int64), (num_uses, np.int64)):
            if array.dtype != dtype or array.shape != self._shape or not array.flags.c_contiguous:
                raise ValueError(f"finemoe victims kernel: need contiguous {np.dtype(dtype)} {self._shape}, got "
                                 f"{array.dtype} {array.shape}")
        mask = self._protected
        marked = list(protected)
        try:
            for key in marked:
                mask[key] = 1
            count = self._fn(*self._head, num_uses.ctypes.data, last_used.ctypes.data, resident.ctypes.data,
                             *self._tail, num_victims, *self._floor_out)
        finally:
            for key in marked:
                mask[key] = 0
        return [divmod(index, self._num_experts) for index in self._out[:count].tolist()]


def victim_picker(guide: npt.NDArray[np.float64], prob_floor: float) -> VictimPicker | None:
    """A `VictimPicker` over `guide`, or None where the kernel is not available."""
    lib = _library()
    return None if lib is None else VictimPicker(lib, guide, prob_floor)


class PlanRanker:
    """`rank(resident, current_layer)`: the experts of layers after `current_layer` that are
    `planned` and not `resident`, as (flat [L, E] indices, priorities), best first, exactly as
    `ranking.plan_from_predictions` orders them (§4.5's `p / (l - l_now)` over `probs`, ties in
    (layer, expert) order). `planned` [L, E] (bool) and `probs` (fp64) are the policy's, bound once
    and read in place; `resident` is checked and bound when it is another array than the last call's
    (a cache snapshot's residency array lives on through the lookups that only count visits).

    Why: the NumPy mask this replaces, and even reading an array's address, start cold after every
    MoE layer's GEMM (~30 us on the AVX2 host, for a plan that is empty nine times in ten); a
    ctypes call on bound addresses costs ~4 us there (docs/offload.md, "Cold after the GEMM")."""

    def __init__(self, lib: ctypes.CDLL, planned: npt.NDArray[np.bool_], probs: npt.NDArray[np.float64]) -> None:
        if planned.ndim != 2:
            raise ValueError(f"finemoe plan kernel: planned must be [L, E], got {planned.shape}")
        self._shape = planned.shape
        _check_arrays("plan", {"planned": (planned, np.bool_, self._shape), "probs": (probs, np.float64, self._shape)})
        self._fn = lib.emoe_plan_from_predictions
        self._arrays = (planned, probs)  # kept alive
        self._index = np.zeros(planned.size, dtype=np.int64)
        self._priority = np.zeros(planned.size, dtype=np.float64)
        self._head = (planned.ctypes.data, probs.ctypes.data)
        self._tail = (*self._shape, self._index.ctypes.data, self._priority.ctypes.data)
        self._resident: npt.NDArray[np.bool_] | None = None  # the last one bound, kept alive with its address
        self._resident_address = 0

    def rank(self, resident: npt.NDArray[np.bool_], current_layer: int) -> tuple[list[int], list[float]]:
        if resident is not self._resident:
            _check_arrays("plan", {"resident": (resident, np.bool_, self._shape)})
            self._resident, self._resident_address = resident, resident.ctypes.data
        count = self._fn(*self._head, self._resident_address, current_layer, *self._tail)
        if count < 0:
            raise ValueError(f"finemoe plan kernel: current layer {current_layer} out of range")
        if count == 0:
            return [], []
        return self._index[:count].tolist(), self._priority[:count].tolist()


def plan_ranker(planned: npt.NDArray[np.bool_], probs: npt.NDArray[np.float64]) -> PlanRanker | None:
    """A `PlanRanker` over a policy's `planned` and `probs`, or None where the kernel is not available."""
    lib = _library()
    return None if lib is None else PlanRanker(lib, planned, probs)


class StorePlacer:
    """`place(...)`: §4.4's placement of new records in a full Expert Map Store, one at a time in
    order, as `ExpertMapStore.insert_many`'s NumPy loop does (see `emoe_finemoe_place`), over the
    store's arrays bound once (they keep their buffers for the store's life): `embeddings` [C, h],
    `embedding_norms` [C], `maps` [L, C, E], `columns` [L, E, C], `trajectory_norms` [L, C],
    `stamps` and `last_matched` [C]."""

    def __init__(self, lib: ctypes.CDLL, embeddings: npt.NDArray[np.float32], embedding_norms: npt.NDArray[np.float32],
                 maps: npt.NDArray[np.float32], columns: npt.NDArray[np.float32],
                 trajectory_norms: npt.NDArray[np.float32], stamps: npt.NDArray[np.int64],
                 last_matched: npt.NDArray[np.int64]) -> None:
        num_layers, capacity, num_experts = maps.shape
        self.hidden = embeddings.shape[1]
        shapes: dict[str, ArraySpec] = {
            "embeddings": (embeddings, np.float32, (capacity, self.hidden)),
            "embedding_norms": (embedding_norms, np.float32, (capacity,)),
            "maps": (maps, np.float32, (num_layers, capacity, num_experts)),
            "columns": (columns, np.float32, (num_layers, num_experts, capacity)),
            "trajectory_norms": (trajectory_norms, np.float32, (num_layers, capacity)),
            "stamps": (stamps, np.int64, (capacity,)),
            "last_matched": (last_matched, np.int64, (capacity,)),
        }
        _check_arrays("placement", shapes)
        self._fn = lib.emoe_finemoe_place
        self._arrays = tuple(array for array, _, _ in shapes.values())  # kept alive
        self.capacity, self.map_size = capacity, num_layers * num_experts
        self._head = (*(array.ctypes.data for array in self._arrays), capacity, num_layers, num_experts, self.hidden)

    def place(self, embeddings: npt.NDArray[np.float32], maps: npt.NDArray[np.float32],
              redundancy: npt.NDArray[np.float32] | None, searched: Sequence[npt.NDArray[np.float32]] | None,
              w_sem: float, num_added: int) -> tuple[list[int], int]:
        """Place the records `embeddings` [B, h] and `maps` [B, L * E] given their RDY against the
        store as it stands: `redundancy` [B, C] (updated in place), or the iteration's searches it
        comes from, `searched` = (eq. 4's scores [B, C], eq. 5's dot products [B, C], the records'
        squared norms [B], the stored maps' norms floored [C]; see `map_store.SearchedScores`).
        Returns their slots and the store's new count of records added."""
        batch, f32 = embeddings.shape[0], np.float32
        inputs: dict[str, ArraySpec] = {"embeddings": (embeddings, f32, (batch, self.hidden)),
                                        "maps": (maps, f32, (batch, self.map_size))}
        if searched is not None:
            redundancy = np.empty((batch, self.capacity), dtype=f32)
            for name, array, shape in zip(("semantic", "trajectory_dots", "trajectory_sq", "trajectory_norms"),
                                          searched, ((batch, self.capacity), (batch, self.capacity), (batch,),
                                                     (self.capacity,)), strict=True):
                inputs[name] = (array, f32, shape)
        if redundancy is None:
            raise ValueError("finemoe placement kernel: needs the redundancy or the searches it comes from")
        inputs["redundancy"] = (redundancy, f32, (batch, self.capacity))
        _check_arrays("placement", inputs)
        from_searches = (0, 0, 0, 0) if searched is None else tuple(array.ctypes.data for array in searched)
        slots = np.zeros(batch, dtype=np.int64)
        added = self._fn(*self._head, embeddings.ctypes.data, maps.ctypes.data, batch, redundancy.ctypes.data,
                         *from_searches, w_sem, num_added, slots.ctypes.data)
        if added < 0:
            raise ValueError(f"finemoe placement kernel: arguments out of range (batch {batch})")
        return slots.tolist(), int(added)


def store_placer(embeddings: npt.NDArray[np.float32], embedding_norms: npt.NDArray[np.float32],
                 maps: npt.NDArray[np.float32], columns: npt.NDArray[np.float32],
                 trajectory_norms: npt.NDArray[np.float32], stamps: npt.NDArray[np.int64],
                 last_matched: npt.NDArray[np.int64]) -> StorePlacer | None:
    """A `StorePlacer` over a store's arrays, or None where the kernel is not available."""
    lib = _library()
    return None if lib is None else StorePlacer(lib, embeddings, embedding_norms, maps, columns, trajectory_norms,
                                                stamps, last_matched)


def semantic_best(dots: npt.NDArray[np.float32], queries: npt.NDArray[np.float32],
                  stored_norms: npt.NDArray[np.float32], stamps: npt.NDArray[np.int64],
                  last_matched: npt.NDArray[np.int64], num_added: int
                  ) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.float32]] | None:
    """Eq. 4 after its matrix product: `dots` [B, C] (the `queries` [B, h] times the C stored
    embeddings, whose norms are `stored_norms` [C]) become the cosines in place; per query the best
    record, ties to the highest of `stamps` [C], is returned (index [B], score [B]) and stamped
    `num_added` in `last_matched` (the store's `mark_matched`). One call for the ten small NumPy
    operations of the cosines and the best match. None where the kernel is not available (nothing
    done)."""
    lib = _library()
    if lib is None:
        return None
    batch, hidden = queries.shape
    num_records = dots.shape[1]
    _check_arrays("semantic", {"dots": (dots, np.float32, (batch, num_records)),
                               "queries": (queries, np.float32, (batch, hidden)),
                               "stored_norms": (stored_norms, np.float32, (num_records,)),
                               "stamps": (stamps, np.int64, (num_records,))})
    _check_last_matched("semantic", last_matched, num_records)
    index = np.empty(batch, dtype=np.int64)
    best = np.empty(batch, dtype=np.float32)
    if lib.emoe_finemoe_semantic_best(dots.ctypes.data, queries.ctypes.data, batch, hidden, stored_norms.ctypes.data,
                                      stamps.ctypes.data, num_records, index.ctypes.data, best.ctypes.data,
                                      last_matched.ctypes.data, num_added) != 0:
        raise ValueError(f"finemoe semantic kernel: empty arguments: dots {dots.shape}, queries {queries.shape}")
    return index, best
