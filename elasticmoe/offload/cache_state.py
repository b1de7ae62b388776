"""What the expert cache holds, as an immutable snapshot the engine owns.

The expert cache is one global pool of `capacity` expert slots shared by all MoE layers
(the HMM's page pool backs every layer's virtual expert tensor, so a slot freed in one
layer can hold an expert of another). All experts of a model have the same size (FineMoE
§3.3 assumes homogeneous `M_e`), so a slot budget is a byte budget divided by the expert
size. A global budget is what FineMoE's constraint (3) states (`|E_cache| * M_e <= M`) and
what its eviction priority needs: it ranks every cached expert, whatever its layer.

Besides residency the snapshot keeps the two usage facts eviction policies read:

- `last_used[l, e]`: the clock value of the expert's last use or load (LRU);
- `num_uses[l, e]`: its visit count (LFU, FineMoE's `freq`). One visit per (iteration,
  layer, expert) lookup, however many tokens the iteration routed to it: a 500-token
  prefill is one lookup of each expert it needs, not 500 (see `use`). Counts persist
  across evictions: they measure how popular an expert is, not how long it stayed.
  They age: every `ageing_window` visits all counts are halved (TinyLFU's reset), so the
  popularity is that of recent traffic. Without it a server that served one topic for a day
  would keep that topic's experts against the next topic's for as many visits again; halving
  keeps the counts' order (up to ties among the smallest) while old visits fade geometrically.

Invariants (checked by `check_integrity`; construction checks the shapes and the capacity):
the arrays are `[L, E]` and read-only; at most `capacity` experts are resident;
`last_used < clock`; visit counts are non-negative.
Transitions return a new snapshot; nothing mutates one, so a prefetch thread may read a
snapshot while the forward thread builds the next.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

# (layer, expert): layer indexes the MoE layers 0..L-1, expert the routed experts 0..E-1.
ExpertKey = tuple[int, int]

# The visits between two halvings of the counts, per (layer, expert) of the model: each expert
# seen 16 times on average. TinyLFU resets after 10 samples per cache entry; ours counts per key,
# and a cache of a quarter of the experts makes this ~64 per entry, so that a decode-heavy run
# (4 experts per layer and token) ranks by a few hundred iterations of history.
AGEING_VISITS_PER_EXPERT = 16

BoolGrid = npt.NDArray[np.bool_]
IntGrid = npt.NDArray[np.int64]


@dataclass(frozen=True, slots=True, eq=False)
class CacheState:
    """Residency and usage of every routed expert under a global slot budget."""

    capacity: int  # expert slots
    resident: BoolGrid  # [L, E]
    last_used: IntGrid  # [L, E] clock of the last use or load; -1 = never
    num_uses: IntGrid  # [L, E] visits, halved every `ageing_window` visits
    clock: int = 0  # the next stamp; advances once per `load` / `use`
    ageing_window: int = 0  # visits between two halvings of `num_uses`; 0: never halved
    visits_since_ageing: int = 0
    # `resident`'s count, kept by the transitions: the engine asks for the free slots at every plan
    num_resident: int = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if self.capacity < 1:
            raise ValueError(f"cache capacity: need >= 1 expert slot, got {self.capacity}")
        for arr in (self.resident, self.last_used, self.num_uses):
            arr.flags.writeable = False  # snapshots are shared between threads: no writes
        shape = self.resident.shape
        if len(shape) != 2 or self.last_used.shape != shape or self.num_uses.shape != shape:
            raise ValueError(f"cache arrays: need three [L, E] arrays, got {shape}, {self.last_used.shape}, "
                             f"{self.num_uses.shape}")
        object.__setattr__(self, "num_resident", int(self.resident.sum()))
        if self.num_resident > self.capacity:
            raise ValueError(f"cache: {self.num_resident} resident experts exceed the capacity {self.capacity}")
        if self.ageing_window < 0 or self.visits_since_ageing < 0:
            raise ValueError(f"cache ageing: need a window >= 0 and visits >= 0, got {self.ageing_window}, "
                             f"{self.visits_since_ageing}")

    @classmethod
    def empty(cls, num_layers: int, num_experts: int, capacity: int, ageing_window: int | None = None) -> CacheState:
        """No expert resident. `ageing_window`: visits between halvings of the counts (default
        `AGEING_VISITS_PER_EXPERT` per (layer, expert); 0: never)."""
        if num_layers < 1 or num_experts < 1:
            raise ValueError(f"cache shape: need >= 1 layer and expert, got [{num_layers}, {num_experts}]")
        shape = (num_layers, num_experts)
        window = AGEING_VISITS_PER_EXPERT * num_layers * num_experts if ageing_window is None else ageing_window
        return cls(capacity, np.zeros(shape, dtype=np.bool_), np.full(shape, -1, dtype=np.int64),
                   np.zeros(shape, dtype=np.int64), ageing_window=window)

    # ---- predicates ---------------------------------------------------------------

    @property
    def num_layers(self) -> int:
        return int(self.resident.shape[0])

    @property
    def num_experts(self) -> int:
        return int(self.resident.shape[1])

    @property
    def num_free(self) -> int:
        return self.capacity - self.num_resident

    @property
    def is_full(self) -> bool:
        return self.num_free == 0

    def is_resident(self, key: ExpertKey) -> bool:
        return bool(self.resident[key])

    def resident_keys(self) -> list[ExpertKey]:
        """Resident experts in (layer, expert) order."""
        return [(int(layer), int(expert)) for layer, expert in np.argwhere(self.resident)]

    def missing(self, layer: int, expert_ids: Iterable[int]) -> list[int]:
        """The experts of `layer` among `expert_ids` that are not resident, sorted, once each."""
        row = self.resident[layer]
        return sorted({int(e) for e in expert_ids if not row[int(e)]})

    # ---- transitions ----------------------------------------------------------------

    def load(self, keys: Sequence[ExpertKey]) -> CacheState:
        """`keys` become resident, stamped with the clock as if just used (LRU counts a load)."""
        if not keys:
            return self
        resident, last_used = self.resident.copy(), self.last_used.copy()
        for key in keys:
            if resident[key]:
                raise ValueError(f"load: expert {key} is already resident")
            resident[key] = True
            last_used[key] = self.clock
        if len(keys) > self.num_free:
            raise ValueError(f"load: {len(keys)} experts do not fit in {self.num_free} free slots")
        return self._successor(resident, last_used, self.num_uses, self.clock + 1, self.num_resident + len(keys))

    def evict(self, keys: Sequence[ExpertKey]) -> CacheState:
        """`keys` leave the cache; their visit counts stay (see the module docstring)."""
        if not keys:
            return self
        resident = self.resident.copy()
        for key in keys:
            if not resident[key]:
                raise ValueError(f"evict: expert {key} is not resident")
            resident[key] = False
        return self._successor(resident, self.last_used, self.num_uses, self.clock, self.num_resident - len(keys))

    def reinstate(self, keys: Sequence[ExpertKey]) -> CacheState:
        """`keys`, evicted for a copy that was cancelled before it wrote their rows, are resident
        again with the stamps they had: nothing about them changed (unlike `load`, which stamps)."""
        if not keys:
            return self
        resident = self.resident.copy()
        for key in keys:
            if resident[key]:
                raise ValueError(f"reinstate: expert {key} is already resident")
            resident[key] = True
        if len(keys) > self.num_free:
            raise ValueError(f"reinstate: {len(keys)} experts do not fit in {self.num_free} free slots")
        return self._successor(resident, self.last_used, self.num_uses, self.clock, self.num_resident + len(keys))

    def use(self, layer: int, expert_ids: Iterable[int]) -> CacheState:
        """Layer `layer` ran its experts `expert_ids` (all resident): one visit each, whatever
        the number of tokens routed to an expert, and each stamped with the clock."""
        return self.use_many([(layer, expert_ids)])

    def use_many(self, uses: Iterable[tuple[int, Iterable[int]]]) -> CacheState:
        """`use` of each (layer, expert_ids) in order, as one transition: the same snapshot as
        the chain of `use`s (the engine applies a step's hits together when it next needs them)."""
        last_used: IntGrid | None = None
        num_uses = self.num_uses
        clock, since = self.clock, self.visits_since_ageing
        for layer, expert_ids in uses:
            ids = sorted({int(e) for e in expert_ids})
            if not ids:
                continue
            # NOTE: element loops, not fancy indexing: this runs per MoE layer of every step on a
            # handful of experts, where NumPy's index conversion costs more than the writes.
            resident = self.resident[layer]
            absent = [e for e in ids if not resident[e]]
            if absent:
                raise ValueError(f"use: layer {layer} experts {absent} are not resident")
            if last_used is None:
                last_used, num_uses = self.last_used.copy(), self.num_uses.copy()
            stamps, visits = last_used[layer], num_uses[layer]
            for e in ids:
                stamps[e] = clock
                visits[e] += 1
            since += len(ids)
            if self.ageing_window and since >= self.ageing_window:
                num_uses //= 2
                since = 0
            clock += 1
        if last_used is None:
            return self
        return self._successor(self.resident, last_used, num_uses, clock, self.num_resident, since)

    def _successor(self, resident: BoolGrid, last_used: IntGrid, num_uses: IntGrid, clock: int, num_resident: int,
                   visits_since_ageing: int | None = None) -> CacheState:
        """A transition's result, whose invariants the transition kept: made without the checks
        of construction (a transition runs per MoE layer of every engine step)."""
        successor = object.__new__(CacheState)
        since = self.visits_since_ageing if visits_since_ageing is None else visits_since_ageing
        for name, value in (("capacity", self.capacity), ("resident", resident), ("last_used", last_used),
                            ("num_uses", num_uses), ("clock", clock), ("ageing_window", self.ageing_window),
                            ("visits_since_ageing", since), ("num_resident", num_resident)):
            object.__setattr__(successor, name, value)
        for arr in (resident, last_used, num_uses):
            arr.flags.writeable = False
        return successor

    def check_integrity(self) -> None:
        """The invariants construction does not check (O(L * E)); tests and debug runs call it."""
        if self.num_resident != int(self.resident.sum()):
            raise ValueError(f"cache: counts {self.num_resident} resident experts, holds {int(self.resident.sum())}")
        if self.num_resident > self.capacity:
            raise ValueError(f"cache: {self.num_resident} resident experts exceed the capacity {self.capacity}")
        if self.last_used.size and int(self.last_used.max()) >= self.clock:
            raise ValueError(f"cache: a stamp {int(self.last_used.max())} is not before the clock {self.clock}")
        if self.num_uses.size and int(self.num_uses.min()) < 0:
            raise ValueError("cache: negative visit count")
