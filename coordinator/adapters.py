"""Adapters on the elastic server: one registry; ESFT experts in the HMM's pages and every rank's
expert map; LoRA factors in every rank's slots (each rank keeps its own experts' share).

Loading ESFT adapter `A` (`POST /admin/adapters`): a free slot `i` is chosen; the HMM maps
and fills A's experts on the devices that hold the base experts they replace (its
page pools, accounted per device); every rank of the active instance maps the new
rows into its view and points its expert map at them. Only then does `A` appear in
`/v1/models` and accept requests, so no token is routed to a row some rank lacks. With
every slot taken, `A` is registered on disk and swapped in when a request needs it
(`coordinator.esft_residency`).

Unloading (`DELETE`): every rank stops admitting `A` at once; a background task waits
until no rank has a live request of `A` (under EP a rank's tokens reach experts on
other ranks, so no rank may release early), then every rank releases it and the HMM
returns its pages to the pools.

Scaling: the HMM carries every registered adapter into the target layout (pages kept
where an expert stays on its device, read from the adapter's files where it moves);
`prepare_instance` points the new instance's expert maps at them before it takes
requests, and loads the LoRA adapters most likely to be used into its slots first
(`initial_load_order`). Adapter changes and scale events exclude each other (409): a scale never
sees an adapter half-loaded, and an unloading adapter blocks scales until it is gone.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import ray
from ray.exceptions import ActorUnavailableError, GetTimeoutError, RayActorError

from coordinator.esft_residency import EsftResidency
from elasticmoe.adapters.esft import EsftAdapter
from elasticmoe.adapters.lora import LoraAdapter
from elasticmoe.adapters.lora_router import LoraRouter
from elasticmoe.config import ModelConfig
from elasticmoe.errors import (
    AdapterConflictError,
    AdapterLimitError,
    AdapterUnavailableError,
    UnknownAdapterError,
)

if TYPE_CHECKING:
    from coordinator.config import CoordinatorConfig
    from coordinator.scale_events import ScaleEvents
    from hmm.controller import HMMController
    from imm.instance import Instance

logger = logging.getLogger(__name__)

LOCK_WAIT_S = 10.0  # a registration or a manual scale waits this long for the adapter lock (a step)
# How long the ranks may take to answer one adapter call (loading an adapter reads its files: seconds).
# The calls run under the adapter lock: a rank that hangs must not hold every later adapter change
# and every scale behind it forever.
RANK_CALL_S = 120.0


def on_ranks(refs: list[Any], what: str) -> list[Any]:
    """The ranks' answers to one adapter call (`refs`, one per rank), or `AdapterUnavailableError`
    naming `what` when a rank does not answer within RANK_CALL_S or is gone (the healer replaces
    it; the client retries)."""
    try:
        return ray.get(refs, timeout=RANK_CALL_S)
    except GetTimeoutError as exc:
        raise AdapterUnavailableError(f"{what}: a rank did not answer within {RANK_CALL_S:.0f}s; retry") from exc
    except (RayActorError, ActorUnavailableError) as exc:
        raise AdapterUnavailableError(f"{what}: a rank is gone; retry once the server has healed") from exc


@dataclass
class AdapterState:
    name: str
    slot: int | None  # ESFT: its slot; LoRA: the slot it had when loaded (None: host memory only)
    path: str
    experts: dict[int, tuple[int, ...]]
    state: str = "loaded"  # loaded | unloading
    evicting: bool = False  # ESFT: being swapped out of its slot (no rank admits it)
    kind: str = "esft"  # esft | lora
    usage_probability: float | None = None  # declared at registration (CoServe §4.3)
    unloaded: threading.Event = field(default_factory=threading.Event)

    @property
    def order(self) -> tuple[str, int, str]:
        """How listings sort adapters: by kind, then slot (host-only LoRA adapters last), then name."""
        return (self.kind, self.slot if self.slot is not None else 1 << 30, self.name)

    @property
    def is_resident(self) -> bool:
        """Requests for it run now (ESFT: in a slot, not being swapped out; LoRA: in every
        rank's host memory, which the ranks' own swapper serves)."""
        return self.kind != "esft" or (self.slot is not None and not self.evicting)

    def describe(self) -> dict[str, Any]:
        out = {"name": self.name, "type": self.kind, "slot": self.slot, "path": self.path, "state": self.state,
               "resident": self.is_resident, "usage_probability": self.usage_probability}
        if self.kind == "esft":
            out["num_experts"] = sum(len(v) for v in self.experts.values())
        return out


class AdapterCluster(Protocol):
    """What the adapter host needs of the cluster (`coordinator.cluster.ClusterManager` is one)."""

    config: CoordinatorConfig
    hmm: HMMController | None
    scale_events: ScaleEvents

    @property
    def active(self) -> Instance | None: ...


def initial_load_order(adapters: list[AdapterState]) -> list[AdapterState]:
    """The order in which a new instance loads adapters into its free slots (CoServe §4.1:
    descending usage probability until memory is full): the declared probabilities descending,
    then the adapters without one, each group in registration order (`adapters`' order)."""
    return sorted(adapters, key=lambda a: (a.usage_probability is None, -(a.usage_probability or 0.0)))


def _check_backend(backend: str) -> None:
    if backend != "native":  # vLLM replicas serve the base model only
        raise AdapterLimitError(f"adapters need --backend native; this server runs --backend {backend}")


class ClusterAdapterHost:
    """`AdapterHost` of the coordinator (see `elasticmoe.entrypoints.openai.adapters_api`)."""

    def __init__(self, cluster: AdapterCluster, publish: Callable[[tuple[str, ...]], None]) -> None:
        self.cluster = cluster
        self.publish = publish  # what `/v1/models` and the model check see
        self.adapters: dict[str, AdapterState] = {}
        self.routers: dict[str, Any] = {}  # learned LoRA routers (MoLoRA §4.3), loaded on every instance
        self.router_probabilities: dict[str, float | None] = {}  # declared usage (CoServe §4.3)
        self.lock = threading.Lock()  # adapter changes vs scale events (see the module docstring)
        self.poll_s = 0.05
        config = cluster.config
        self.residency = EsftResidency(self, config.adapter_eviction, config.profile)

    @property
    def max_adapters(self) -> int:
        return self.cluster.config.max_esft_adapters

    def publish_registry(self) -> None:
        """The adapters that accept requests (resident or not) changed: publish them."""
        self.publish(tuple(n for n, a in self.adapters.items() if a.state == "loaded"))

    @property
    def swapped_out(self) -> tuple[str, ...]:
        """Accepted adapters a request must wait for (on disk, or being swapped out)."""
        return tuple(n for n, a in self.adapters.items() if a.state == "loaded" and not a.is_resident)

    def swap_stats(self) -> dict[str, Any]:
        """ESFT residency: in a slot / on disk, and the swaps so far; how the ranks swap LoRA adapters."""
        esft = [a for a in list(self.adapters.values()) if a.kind == "esft" and a.state == "loaded"]
        r = self.residency
        return {"eviction": r.policy.name, "esft_resident": sum(a.is_resident for a in esft),
                "esft_on_disk": sum(not a.is_resident for a in esft), "esft_swaps_in": r.num_swaps_in,
                "esft_evictions": r.num_evictions, "esft_swap_s": r.swap_s,
                "esft_unwanted": r.num_unwanted, "lora_swaps": self.lora_swap_mode()}

    def lora_swap_mode(self) -> str | None:
        """"lockstep": the ranks of the active instance swap LoRA adapters together (slots on the
        experts under EP, `engine.lora_lockstep`); "per rank": each its own slots (one rank, or slots
        of attention modules only); None: no LoRA slots."""
        config, inst = self.cluster.config, self.cluster.active
        if not config.max_loras:
            return None
        return "per rank" if config.rank_local_lora_slots or inst is None or inst.dp == 1 else "lockstep"

    def busy_reason(self) -> str | None:
        """Why a scale may not start now (None: it may)."""
        unloading = [n for n, a in self.adapters.items() if a.state == "unloading"]
        return f"adapters {unloading} are unloading" if unloading else None

    def wait_swaps(self, timeout_s: float) -> str | None:
        """A scale started (so no swap starts now): wait until no adapter is being swapped out
        (its running requests finish first). None when settled, else what is still under way."""
        deadline = time.monotonic() + timeout_s
        while True:
            with self.lock:
                evicting = [n for n, a in self.adapters.items() if a.evicting]
            if not evicting:
                return None
            if time.monotonic() > deadline:
                return f"adapter {evicting[0]!r} was still being swapped out after {timeout_s:.0f}s"
            time.sleep(self.poll_s)

    # ---- AdapterHost ------------------------------------------------------------------------

    @functools.cached_property
    def model_config(self) -> ModelConfig:
        """The base model's config: what an adapter's files are checked against."""
        return ModelConfig.from_pretrained(self.cluster.config.model_dir)

    async def load_esft(self, name: str, path: str, usage_probability: float | None = None) -> dict[str, Any]:
        experts = await asyncio.to_thread(self.esft_experts, name, path)
        return await asyncio.to_thread(self.load_blocking, name, path, experts, usage_probability)

    def esft_experts(self, name: str, path: str) -> dict[int, tuple[int, ...]]:
        """The tuned experts per layer of the ESFT adapter at `path`, once its files are checked
        against the base (an `AdapterError` naming the field if the base cannot take them). The
        HMM reads the tensors when it loads them into a slot."""
        adapter = EsftAdapter.open(name, path, self.model_config)
        adapter.close()
        return adapter.config.experts

    def load_blocking(self, name: str, path: str, experts: dict[int, tuple[int, ...]],
                      usage_probability: float | None = None) -> dict[str, Any]:
        if not self.lock.acquire(timeout=LOCK_WAIT_S):
            raise AdapterConflictError("a scale or another adapter change is in progress; retry")
        try:
            return self._load(name, path, experts, usage_probability)
        finally:
            self.lock.release()

    def _load(self, name: str, path: str, experts: dict[int, tuple[int, ...]],
              usage_probability: float | None) -> dict[str, Any]:
        cluster = self.cluster
        _check_backend(cluster.config.backend)
        if cluster.scale_events.running is not None:
            raise AdapterConflictError("a scale is in progress; retry when it finished")
        if name in self.adapters:
            raise AdapterConflictError(f"adapter {name!r} is already loaded")
        if self.max_adapters == 0:
            raise AdapterLimitError("this server has no ESFT slots (--max-esft-adapters 0)")
        e_max = cluster.config.max_esft_experts
        widest = max((len(v) for v in experts.values()), default=0)
        if widest > e_max:
            raise AdapterLimitError(
                f"the adapter tunes {widest} experts in a layer; a slot holds at most {e_max} (--max-esft-experts)"
            )
        entry = AdapterState(name, None, path, dict(experts), usage_probability=usage_probability)
        slot = self.free_esft_slot()
        if slot is not None:
            self.load_into(entry, slot)
            self.residency.on_resident(name)
        self.adapters[name] = entry  # on disk without a slot: swapped in when a request needs it
        self.publish_registry()
        return {"slot": slot, "num_experts": sum(len(v) for v in experts.values())}

    def free_esft_slot(self) -> int | None:
        taken = {a.slot for a in self.adapters.values() if a.kind == "esft" and a.slot is not None}
        return next((i for i in range(self.max_adapters) if i not in taken), None)

    def load_into(self, entry: AdapterState, slot: int) -> None:
        """Map `entry`'s experts into ESFT slot `slot` (HMM rows, every rank's expert map); all or
        nothing. Under the lock."""
        hmm, inst = self.cluster.hmm, self.cluster.active
        assert hmm is not None and inst is not None
        pages = hmm.load_adapter(entry.name, slot, entry.path, entry.experts)
        try:
            on_ranks([
                rank.load_esft_adapter.remote(entry.name, slot, entry.experts, pages.get(device, {}),
                                              entry.usage_probability)
                for rank, device in zip(inst.ranks, inst.device_ids, strict=True)
            ], f"loading adapter {entry.name!r}")
        except BaseException:
            logger.exception("adapter %r: a rank failed to load it; undoing", entry.name)
            self.release_everywhere(entry.name, inst, kind="esft")
            raise
        entry.slot = slot

    def stop_admitting(self, name: str) -> None:
        """Every rank of the active instance turns `name`'s new requests away (the ingress waits
        and sends them again); its running requests go on. Under the lock."""
        inst = self.cluster.active
        assert inst is not None
        self.publish_registry()  # the ingress stops sending them first
        on_ranks([rank.unload_adapter.remote(name) for rank in inst.ranks], f"swapping out adapter {name!r}")

    async def load_lora(self, name: str, path: str, usage_probability: float | None = None) -> dict[str, Any]:
        # Checked here first: a rank's own check would fail alike, but only after others loaded it.
        await asyncio.to_thread(LoraAdapter.open, name, path, self.model_config)
        return await asyncio.to_thread(self.load_lora_blocking, name, path, usage_probability)

    def load_lora_blocking(self, name: str, path: str, usage_probability: float | None = None) -> dict[str, Any]:
        """Every rank loads the adapter (its own experts' factors) into the same slot: the ranks'
        slot tables stay equal because they load the same adapters in the same order."""
        if not self.lock.acquire(timeout=LOCK_WAIT_S):
            raise AdapterConflictError("a scale or another adapter change is in progress; retry")
        try:
            cluster = self.cluster
            _check_backend(cluster.config.backend)
            if cluster.config.max_loras == 0:
                raise AdapterLimitError("this server has no LoRA slots (--max-loras 0)")
            if cluster.scale_events.running is not None:
                raise AdapterConflictError("a scale is in progress; retry when it finished")
            if name in self.adapters:
                raise AdapterConflictError(f"adapter {name!r} is already loaded")
            inst = cluster.active
            assert inst is not None
            try:
                slots = on_ranks([rank.load_lora_adapter.remote(name, path, usage_probability) for rank in inst.ranks],
                                 f"loading adapter {name!r}")
            except BaseException:
                logger.exception("adapter %r: a rank failed to load it; undoing", name)
                on_ranks([rank.finish_adapter_unload.remote(name, {}) for rank in inst.ranks],
                         f"undoing adapter {name!r}")
                raise
            # A slot, or None: it waits in every rank's host memory until a request needs it.
            self.adapters[name] = AdapterState(name, self._lora_slot(name, slots), path, {}, kind="lora",
                                               usage_probability=usage_probability)
            self.publish_registry()
            return {"slot": self.adapters[name].slot}
        finally:
            self.lock.release()

    async def load_router(self, name: str, path: str, usage_probability: float | None = None) -> dict[str, Any]:
        router = await asyncio.to_thread(LoraRouter.open, path)
        return await asyncio.to_thread(self.load_router_blocking, name, router, usage_probability)

    def load_router_blocking(self, name: str, router: Any, usage_probability: float | None = None) -> dict[str, Any]:
        """Register a learned LoRA router on every rank (and on every later instance)."""
        with self.lock:
            if self.cluster.scale_events.running is not None:
                raise AdapterConflictError("a scale is in progress; retry when it finished")
            inst = self.cluster.active
            assert inst is not None
            on_ranks([rank.load_lora_router.remote(name, router, usage_probability) for rank in inst.ranks],
                     f"loading router {name!r}")
            self.routers[name] = router
            self.router_probabilities[name] = usage_probability
        return {"adapters": list(router.adapters), "top_k": router.top_k}

    async def unload(self, name: str) -> bool:
        return await asyncio.to_thread(self.unload_blocking, name)

    def unload_blocking(self, name: str, wait: bool = False) -> bool:
        """Stop admitting `name` everywhere; release it in the background once no rank uses it.
        Returns True if it is already gone (`wait=True`: waits for that)."""
        with self.lock:
            if name in self.routers:  # a learned router: every rank drops it at once
                inst = self.cluster.active
                assert inst is not None
                on_ranks([rank.unload_adapter.remote(name) for rank in inst.ranks], f"unloading router {name!r}")
                del self.routers[name]
                self.router_probabilities.pop(name, None)
                return True
            entry = self.adapters.get(name)
            if entry is None or entry.state != "loaded":
                raise UnknownAdapterError(name)
            dependents = sorted(r for r, router in self.routers.items() if name in router.adapters)
            if dependents:
                raise AdapterConflictError(f"adapter {name!r} is routed to by learned routers {dependents}; they "
                                           "depend on it")
            if entry.evicting:
                raise AdapterConflictError(f"adapter {name!r} is being swapped out of its slot; retry")
            if entry.kind == "esft" and entry.slot is None:  # on disk only: nothing is mapped anywhere
                del self.adapters[name]
                self.residency.forget(name)
                self.publish_registry()
                entry.unloaded.set()
                return True
            inst = self.cluster.active
            assert inst is not None
            entry.state = "unloading"
            self.publish_registry()
            try:
                on_ranks([rank.unload_adapter.remote(name) for rank in inst.ranks], f"unloading adapter {name!r}")
            except AdapterUnavailableError:  # some ranks may have stopped it: finish in the background
                logger.warning("adapter %r: a rank did not confirm it stopped admitting it; the unload goes on",
                               name, exc_info=True)
        threading.Thread(target=self._finish_unload, args=(entry,), name=f"unload-{name}", daemon=True).start()
        if wait:
            entry.unloaded.wait()
        return entry.unloaded.is_set()

    def _finish_unload(self, entry: AdapterState) -> None:
        try:
            while True:
                inst = self.cluster.active
                assert inst is not None
                try:
                    in_use = on_ranks([r.adapter_in_use.remote(entry.name) for r in inst.ranks],
                                      f"unloading adapter {entry.name!r}")
                except AdapterUnavailableError:  # a rank hung or gone: ask the active instance again
                    logger.warning("adapter %r: a rank did not answer whether it is in use; asking again",
                                   entry.name)
                    in_use = [True]
                if not any(in_use):
                    break
                threading.Event().wait(self.poll_s)
            with self.lock:
                self.release_everywhere(entry.name, inst)
                del self.adapters[entry.name]
                self.residency.forget(entry.name)
                # the engines dropped the routers over it too (`LLMEngine._release`)
                self.routers = {k: r for k, r in self.routers.items() if entry.name not in r.adapters}
        except Exception:  # noqa: BLE001 - the adapter stays "unloading" (visible), scales stay blocked
            logger.exception("adapter %r: unloading failed", entry.name)
            return
        entry.unloaded.set()
        logger.info("adapter %r unloaded", entry.name)

    def release_everywhere(self, name: str, inst: Instance, kind: str | None = None) -> None:
        """Every rank of `inst` releases `name` (no live request may use it), then the HMM frees
        its rows (ESFT). Under the lock."""
        hmm = self.cluster.hmm
        assert hmm is not None
        entry = self.adapters.get(name)
        if (kind or (entry.kind if entry is not None else "esft")) == "lora":  # the ranks hold the factors
            on_ranks([rank.finish_adapter_unload.remote(name, {}) for rank in inst.ranks], f"releasing adapter {name!r}")
            return
        rows = hmm.adapter_rows(name)
        try:
            on_ranks([
                rank.finish_adapter_unload.remote(name, rows.get(device, {}))
                for rank, device in zip(inst.ranks, inst.device_ids, strict=True)
            ], f"releasing adapter {name!r}")
        finally:
            hmm.unload_adapter(name)

    async def describe(self) -> list[dict[str, Any]]:
        return [a.describe() for a in sorted(self.adapters.values(), key=lambda a: a.order)]

    # ---- scaling --------------------------------------------------------------------------

    def _lora_slot(self, name: str, slots: list[int | None]) -> int | None:
        """The slot the ranks loaded LoRA adapter `name` into (None: host memory only). Ranks that
        swap in lockstep choose the same; ranks that swap their own slots (`CoordinatorConfig.
        rank_local_lora_slots`) may not, and then it has no one slot (None)."""
        if len(set(slots)) == 1:
            return slots[0]
        if not self.cluster.config.rank_local_lora_slots:
            raise RuntimeError(f"adapter {name!r}: ranks chose different slots {slots}")
        return None

    def prepare_instance(self, inst: Instance) -> None:
        """Point a new instance's expert maps at the registered adapters' rows (which the HMM
        layout it attached to already holds). Before it takes any request."""
        # NOTE: the most probable LoRA adapters take the new instance's free slots (every rank loads
        # in this order, so their slot tables stay equal); the rest wait in host memory.
        for a in initial_load_order(list(self.adapters.values())):
            if a.kind == "lora":  # read from the adapter's files for this instance's placement
                slots = on_ranks([rank.load_lora_adapter.remote(a.name, a.path, a.usage_probability)
                                  for rank in inst.ranks], f"loading adapter {a.name!r} on a new instance")
                a.slot = self._lora_slot(a.name, slots)  # the slot it has in this instance (or None: host memory)
            elif a.slot is not None:  # resident ESFT: the HMM layout holds its rows
                on_ranks([rank.load_esft_adapter.remote(a.name, a.slot, a.experts, None, a.usage_probability)
                          for rank in inst.ranks], f"loading adapter {a.name!r} on a new instance")
                if a.evicting:  # a swap is taking it out: the new ranks do not admit it either
                    on_ranks([rank.unload_adapter.remote(a.name) for rank in inst.ranks],
                             f"swapping out adapter {a.name!r} on a new instance")
        for name, router in self.routers.items():
            on_ranks([rank.load_lora_router.remote(name, router, self.router_probabilities.get(name))
                      for rank in inst.ranks], f"loading router {name!r} on a new instance")

