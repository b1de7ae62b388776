"""`EngineBackend`: the engine of one instance rank, behind one interface (DESIGN.md, "Engines behind
one interface").

`InstanceRank` (the Ray actor) owns what is the same for every engine: its group, its batched
output streams, the handover routes of exported requests. Everything that touches an engine goes
through this interface, implemented by

- `imm.native_backend.NativeBackend`: ElasticMoE's engine (expert parallelism over the instance's
  gloo group, ESFT/LoRA adapters, live handover with the KV blocks in a shared pool);
- `imm.vllm_backend.VllmBackend`: vLLM (the optional `vllm` extra): a data-parallel replica holding
  every expert, its weights taken from the HMM by a vLLM model loader of ours; a request handed over
  is recomputed from its tokens on the new replica.

Lifecycle (the rank checks the order): `prepare` (standby) -> `attach` (weights from HMM handles)
-> `start` + `warm_up` -> serving (`generate`, `resume`, `abort`) -> `pause` (at a step boundary)
-> `export_requests` + `hand_over_streams`, or `reinstate` -> `shutdown`. A new rank of a
switchover `import_requests` what an old one exported (`imm.handover`).

Invariants: a backend hosts at most one engine, in this process; `generate`/`resume` streams
end with a finished output, or raise `HandedOver` (exported at a pause: the rank turns it into a
marker) or `EngineDeadError`; after `export_requests` the engine never steps again.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, Protocol

if TYPE_CHECKING:  # the rank's actor module imports this one, and the ingress loads that (imm.rank)
    from elasticmoe.config import EngineOptions
    from elasticmoe.engine.engine_request import EngineRequest
    from elasticmoe.engine.handover import RequestSnapshot
    from elasticmoe.outputs import RequestOutput
    from elasticmoe.parallel.expert_placement import ExpertPlacement
    from hmm.providers import Handle

BackendName = Literal["native", "vllm"]
BACKENDS: tuple[BackendName, ...] = ("native", "vllm")


@dataclass(frozen=True, slots=True)
class EngineCounters:
    """What a rank reports of its engine (`RankStats`): a consistent int each, not one snapshot."""

    num_running: int = 0
    num_waiting: int = 0
    num_kv_blocks: int = 0
    num_free_kv_blocks: int = 0
    num_steps: int = 0
    lora: dict[str, int] = field(default_factory=dict)  # LoRA slot counters (native; empty without LoRA)
    arrange_us: int = 0  # time the scheduler spent arranging its window (native)
    expert_cache: dict[str, int] = field(default_factory=dict)  # expert offloading counters (native; empty: off)
    num_prefix_cache_queries: int = 0  # prompt tokens looked up in the prefix cache (native)
    num_prefix_cache_hits: int = 0  # ... found there


class AttachResult(Protocol):
    """What `attach` reports: whether the weights are the HMM's memory where the engine keeps a
    tensor as given (`imm.zero_copy.AttachReport`, `imm.vllm_loader.WeightReport`)."""

    @property
    def is_zero_copy(self) -> bool: ...
    @property
    def attach_s(self) -> float: ...


class EngineBackend(Protocol):
    """One rank's engine (see the module docstring)."""

    name: BackendName
    uses_ep_group: bool  # the instance's ranks step in lockstep over one gloo group (expert parallelism)

    # ---- standby / attach ---------------------------------------------------------------
    async def prepare(
        self, model_dir: str, options: EngineOptions, rank: int, dp: int, seed: Mapping[str, Handle] | None
    ) -> None:
        """Standby: everything that needs no target weights. `seed`: a handle set of the committed
        layout holding the same bytes as this rank's target (a replica on this node), which a backend
        may build its engine on ahead of `attach`; None: nothing to build on."""
        ...

    async def attach(
        self, handle_set: Mapping[str, Handle], placement: ExpertPlacement, group: Any, fence_kv: bool
    ) -> AttachResult:
        """Use this rank's device tensors (the HMM's handle set) for the engine's weights."""
        ...

    # ---- serving ------------------------------------------------------------------------
    def start(self, wake_peers: Callable[[], None] | None = None) -> None: ...
    def wake(self) -> None: ...
    async def warm_up(self, request: EngineRequest) -> None: ...
    def generate(self, request: EngineRequest) -> AsyncIterator[RequestOutput]: ...
    def resume(self, request_id: str) -> AsyncIterator[RequestOutput]: ...
    async def abort(self, request_id: str) -> None: ...
    def check_health(self) -> None: ...
    def counters(self) -> EngineCounters: ...

    @property
    def is_started(self) -> bool: ...
    @property
    def is_pausing(self) -> bool: ...
    @property
    def is_paused(self) -> bool: ...
    @property
    def max_model_len(self) -> int: ...

    # ---- switchover ---------------------------------------------------------------------
    def pause(self) -> None: ...
    def export_requests(self, hand_over_kv: bool) -> list[RequestSnapshot]: ...
    def hand_over_streams(self, request_ids: list[str]) -> None: ...
    async def import_requests(self, snaps: Sequence[RequestSnapshot], kv_is_shared: bool) -> dict[str, int]: ...
    async def reinstate(self, snaps: Sequence[RequestSnapshot], kv_kept: bool) -> None: ...
    def unresumed(self, request_ids: list[str]) -> list[str]: ...

    # ---- teardown -----------------------------------------------------------------------
    async def stop(self) -> None: ...
    async def shutdown(self) -> None: ...


def make_backend(name: BackendName) -> EngineBackend:
    """A fresh backend; vLLM's is imported only when asked for (it is an optional extra)."""
    if name == "native":
        from imm.native_backend import NativeBackend

        return NativeBackend()
    if name == "vllm":
        from imm.vllm_backend import VllmBackend

        return VllmBackend()
    raise ValueError(f"backend: expected one of {', '.join(BACKENDS)}, got {name!r}")
