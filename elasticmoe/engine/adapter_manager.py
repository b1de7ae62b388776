"""`AdapterManager`: every adapter of one engine, behind the few calls the engine makes around a step.

It owns the ESFT slots (ExpertWeave: adapter experts as rows of the virtual weight
tensor) with, on one rank, the ESFT adapters registered beyond them (`EsftDiskTier`), the
LoRA slots with their host cache and swapper (MoLoRA's hot set, admitted by CoServe's
scheduling window), the learned LoRA routers, and which adapters accept requests. The adapter packages attach to the model from outside, through the hooks the
model defines (`models.common.ExpertsHook`, the LoRA sites, `MoEBlock.reroute`).

The engine calls, on its thread:

- `bind(request, ref)` when a request arrives: its ESFT slot, its LoRA slot(s), or "waiting
  for a swap"; raises `UnknownAdapterError` (nothing kept) for an adapter not loaded;
- `rebind(request)` when a handed-over request arrives (its adapters are loaded here too);
- `before_step()`: swap in the adapters the scheduling window needs (and the ESFT adapter the
  longest-waiting request needs); returns the requests whose adapter could not be read;
- `wait_for_swap()`: nothing could be scheduled; wait for a copy in flight (one rank only);
- `after_step()`: release the adapters whose unload was asked once no live request uses them
  (one rank only; under EP the coordinator does it for every rank at once), and preload the most
  probable LoRA adapter out of the slots where that displaces a less probable idle one (one rank,
  or slots of attention modules only, which each rank swaps on its own; with slots on the experts
  under EP the lockstep loop does it for every rank alike).

The server calls `load_esft` / `load_lora` / `load_router` / `unload` / `discard` /
`finish_unload` / `in_use` / `stats`, through the engine's thread too. `served` is one tuple
assignment, so any thread may read it.

Usage probabilities (CoServe §4.3, the eviction's stage 2): from the profile named by
`EngineConfig.adapter_profile`, else the `usage_probability` given at load, else the observed
request rate (`elasticmoe.adapter_policy.usage`).
"""

from __future__ import annotations

import itertools
import json
import logging
from collections.abc import Callable, Iterable
from typing import Any

from elasticmoe.adapter_policy.profile import load_profile
from elasticmoe.adapter_policy.usage import check_probability
from elasticmoe.adapters.esft_slots import EsftSlots, ExpertWeights
from elasticmoe.adapters.lora_router import LoraRouter
from elasticmoe.adapters.lora_routing import LearnedRouting, VocabRouting
from elasticmoe.adapters.lora_slots import LoraSlots, LoraWeights
from elasticmoe.config import EngineConfig, ModelConfig
from elasticmoe.engine.engine_request import AdapterRef
from elasticmoe.engine.esft_disk_tier import EsftDiskTier, RowSource
from elasticmoe.engine.lora_lockstep import LockstepLora
from elasticmoe.engine.lora_swapper import LoraSwapper, router_node
from elasticmoe.engine.request import AdapterBinding, Request
from elasticmoe.engine.scheduler import Scheduler
from elasticmoe.errors import (
    AdapterConflictError,
    AdapterError,
    AdapterLimitError,
    InvalidRequestError,
    UnknownAdapterError,
)
from elasticmoe.models.common import CausalLM
from elasticmoe.parallel.expert_placement import ExpertPlacement

logger = logging.getLogger(__name__)


class AdapterManager:
    def __init__(
        self,
        model: CausalLM,
        placement: ExpertPlacement,
        config: EngineConfig,
        model_config: ModelConfig,
        scheduler: Scheduler,
        live: Callable[[], Iterable[Request]],
    ) -> None:
        self.config, self.model_config, self.live, self.scheduler = config, model_config, live, scheduler
        self.is_single_rank = config.ep_size == 1
        self.usage_probability: dict[str, float] = {}  # declared at load, by adapter (routers: router_node)
        profiled = load_profile(config.adapter_profile).usage_probability if config.adapter_profile else {}
        self.esft: EsftSlots | None = None
        self.esft_disk: EsftDiskTier | None = None  # ESFT beyond the slots (one rank; the caller's choice)
        if config.max_esft_adapters:
            self.esft = EsftSlots(model, placement, config.ep_rank, config.max_esft_adapters, config.max_esft_experts)
            if self.is_single_rank:
                self.esft_disk = EsftDiskTier(self.esft, config.adapter_eviction, profiled, self.usage_probability)
        self.lora: LoraSlots | None = None
        self.swapper: LoraSwapper | None = None
        self.routers: dict[str, LoraRouter] = {}
        self.lockstep_lora: LockstepLora | None = None
        self.lora_in_lockstep = False  # the ranks swap LoRA adapters together (`engine.lora_lockstep`)
        if config.max_loras:
            self.lora = LoraSlots(model, placement, config.ep_rank, config.max_loras, config.max_lora_rank,
                                  model.compute_dtype, max_cached=config.max_cpu_loras, top_k=config.max_lora_topk,
                                  target_modules=config.lora_target_modules)
            # NOTE: under EP a slot's expert factors serve every rank's tokens, so a rank cannot swap
            # on its own: the lockstep loop swaps every rank alike at a round boundary. Slots of
            # attention modules only serve this rank's tokens: each rank swaps its own, and the ranks
            # of an instance together hold dp times the distinct adapters. The copies run on the step
            # thread (~0.15 ms for a q/v slot): background fills are made for one rank, whose loop
            # can wait on one (`wait_for_swap`); the lockstep loop does not.
            self.lora_in_lockstep = not self.is_single_rank and self.lora.spans_ranks
            self.swapper = LoraSwapper(self.lora, scheduler, can_swap_async=self.is_single_rank,
                                       eviction=config.adapter_eviction, routers=lambda: self.routers,
                                       profiled=profiled, lockstep=self.lora_in_lockstep,
                                       unloading=lambda: self.unloading)
            if self.lora_in_lockstep:
                self.lockstep_lora = LockstepLora(self.swapper)
        self.unloading: set[str] = set()
        self._swap_failures: list[tuple[Request, BaseException]] = []  # from `wait_for_swap`, for `before_step`
        self.served: tuple[str, ...] = ()  # loaded adapters that accept requests
        # Which load of each adapter is live: a name unloaded and loaded again with other weights
        # must not share the prefix cache's blocks of its earlier load (`AdapterBinding.cache_salt`).
        self._load_ids = itertools.count()
        self._load_id: dict[str, int] = {}
        # Requests bound to each adapter since its load: the coordinator keeps an adapter it just
        # swapped in until the requests that waited for it reached a rank (`admitted`).
        self._num_admitted: dict[str, int] = {}

    @property
    def lora_topk(self) -> int:
        """(slot, weight) pairs every token carries through the model (0: LoRA off)."""
        return self.config.max_lora_topk if self.lora is not None else 0

    # ---- around a step -----------------------------------------------------------------------

    def bind(self, request: Request, ref: AdapterRef) -> None:
        """Set `request`'s adapter, slots and routing from `ref`; raises (request untouched) if
        an adapter is not loaded or the routing is malformed."""
        esft_slot, lora_slot = self._slots(ref.name)
        routing = self._parse_routing(ref.routing) if ref.routing is not None else None
        if routing is not None:
            missing = [n for n in routing.names if self.lora is None or not self.lora.is_loaded(n)
                       or n in self.unloading]
            if missing:
                raise UnknownAdapterError(missing[0])
        request.binding = AdapterBinding(ref.name, esft_slot, lora_slot, routing, is_esft=self._is_esft(ref.name),
                                         cache_salt=self._cache_salt(ref.name, routing, request.params.cache_salt))
        if ref.name in self._num_admitted:
            self._num_admitted[ref.name] += 1
        if request.binding.is_esft:
            if esft_slot < 0:
                request.binding.wait()  # on disk, or being swapped out: `before_step` swaps it in
            if self.esft_disk is not None:
                self.esft_disk.note_arrival(ref.name)  # type: ignore[arg-type]
        if self.swapper is not None:
            if routing is not None:
                self.swapper.assign(request)
                if isinstance(routing, LearnedRouting):
                    self.swapper.note_arrival(router_node(routing.router_name))
                else:  # a per-token table: its request needs each of its adapters
                    for name in sorted(routing.names):
                        self.swapper.note_arrival(name)
            elif ref.name is not None and not request.binding.is_esft:  # a LoRA adapter, resident or not
                if lora_slot < 0:
                    request.binding.wait()
                self.swapper.note_arrival(ref.name)

    def rebind(self, request: Request) -> None:
        """A handed-over request: its slots here (its adapters are loaded here too)."""
        binding = request.binding
        binding.esft_slot, binding.lora_slot = self._slots(binding.name)
        binding.is_esft = self._is_esft(binding.name)
        binding.cache_salt = self._cache_salt(binding.name, binding.routing, request.params.cache_salt)
        if binding.name is not None and binding.esft_slot < 0 and binding.lora_slot < 0:
            binding.wait()
        if binding.routing is not None and self.swapper is not None:
            self.swapper.assign(request)

    def before_step(self) -> list[tuple[Request, BaseException]]:
        """Swap in what waiting requests need. Returns the requests whose ESFT adapter could not be
        read from its files, or whose LoRA adapter's copy into its slot failed (the engine fails
        them alone)."""
        failed, self._swap_failures = self._swap_failures, []
        if self.esft_disk is not None:
            failed += self.esft_disk.swap_in(self.scheduler.waiting, self.scheduler.running)
        if self.swapper is not None:
            failed += self.swapper.swap_in()
        return failed

    def wait_for_swap(self) -> bool:
        """Nothing could be scheduled: if that is because an adapter is still being copied in,
        wait for it instead of spinning, and return True (schedule again)."""
        swapper = self.swapper
        if swapper is None or not swapper.lora.filling or not self.is_single_rank:
            return False
        swapper.lora.wait_for_a_swap()
        self._swap_failures += swapper.swap_in()  # failed at the next step's start
        return True

    def after_step(self) -> None:
        if self.unloading and self.is_single_rank:
            self._finish_unloads()
        self._preload()

    def _preload(self) -> None:
        """One rank: preload the most probable LoRA adapter out of the slots where the rule allows
        (under EP the lockstep loop does it). Optional work: a fault is logged, never raised."""
        if self.swapper is None:
            return
        try:
            self.swapper.preload()
        except Exception:  # noqa: BLE001
            logger.exception("lora: preloading failed")

    # ---- loading and unloading ---------------------------------------------------------------

    def load_esft(self, name: str, experts: dict[int, tuple[int, ...]], expert_weights: ExpertWeights | None,
                  slot: int | None = None, usage_probability: float | None = None,
                  files: RowSource | None = None) -> int | None:
        """Load an ESFT adapter (its tuned experts that live on this rank) into slot `slot` (None:
        a free one). `expert_weights=None`: the provider already filled its rows (HMM memory).
        `usage_probability`: the chance a request uses it, declared (None: unknown). `files`:
        where its rows are read from again, given by a caller that lets this engine swap it out
        and back (one rank only); with every slot taken it is then registered on disk and None
        returned. Raises `AdapterLimitError` / `AdapterConflictError` (409) or `ValueError`
        naming the field."""
        if self.esft is None:
            raise AdapterLimitError("this engine serves no ESFT adapters (--max-esft-adapters 0)")
        self._check_new_name(name)
        self._check_probability(usage_probability)
        tier = self.esft_disk if files is not None else None
        if tier is not None and slot is None and len(self.esft.slot_of) >= self.esft.max_adapters:
            self.esft.check_fits(name, experts, need_slot=False)
            tier.register(name, experts, files)  # type: ignore[arg-type]
            new_slot = None
        else:
            new_slot = self.esft.load(name, experts, expert_weights, slot)
            if tier is not None:
                tier.register(name, experts, files)  # type: ignore[arg-type]
                tier.note_loaded(name)
        self._note_loaded(name)
        self._declare(name, usage_probability)
        self._publish()
        return new_slot

    def load_lora(self, name: str, modules: dict[str, tuple[int, int, int]], weights: LoraWeights, scaling: float,
                  slot: int | None = None, usage_probability: float | None = None) -> int | None:
        """Load a LoRA adapter (`modules`: base module path -> (r, in, out); `weights(path, dtype)`
        -> (A, B)) into host memory and LoRA slot `slot` (None: a free one if any; returns None
        when it waits in host memory until a request needs it). Under EP only this rank's
        experts' factors are kept. `usage_probability`: the chance a request uses it, declared
        (None: unknown; the eviction then falls back to its observed rate unless the profile has
        it). Raises `AdapterLimitError` / `AdapterConflictError` (409) or `ValueError` naming the
        field."""
        if self.lora is None:
            raise AdapterLimitError("this engine serves no LoRA adapters (--max-loras 0)")
        self._check_new_name(name)
        self._check_probability(usage_probability)
        if self.lockstep_lora is not None:
            self.lockstep_lora.check_new(name)
        slot = self.lora.load(name, modules, weights, scaling, slot)
        self._note_loaded(name)
        self._declare(name, usage_probability)
        self._publish()
        if slot is None:
            self._preload()  # a probable adapter registered while the slots are full
        return slot

    def load_router(self, name: str, router: LoraRouter, usage_probability: float | None = None) -> None:
        """Register a learned router (MoLoRA §4.3) over loaded LoRA adapters; requests pick it
        with `lora_routing={"type": "learned", "router": name}`. `usage_probability`: the chance a
        request uses the router (its adapters are then needed together)."""
        self._check_probability(usage_probability)
        if self.lora is None:
            raise AdapterLimitError("this engine serves no LoRA adapters (--max-loras 0)")
        if router.top_k > self.config.max_lora_topk:
            raise AdapterLimitError(f"router top_k {router.top_k} > {self.config.max_lora_topk} (max_lora_topk)")
        missing = [a for a in router.adapters if not self.lora.is_loaded(a) or a in self.unloading]
        if missing:
            raise AdapterError("path", f"router {name!r} routes to adapters {missing} that are not loaded; load "
                               "them first")
        if router.w1.shape[1] != self.model_config.hidden_size:
            raise ValueError(f"path: router input size {router.w1.shape[1]} != hidden size "
                             f"{self.model_config.hidden_size}")
        self.routers[name] = router
        self._declare(router_node(name), usage_probability)

    def unload(self, name: str) -> bool:
        """Stop admitting requests for `name`. With one rank it is unloaded (its rows released)
        once none of its requests is live, now or at the end of a later step; returns True if
        that happened now. A learned router is dropped at once; an adapter a router routes to is
        refused (`AdapterConflictError` naming the routers: unload them first). Under EP other
        ranks route tokens to the experts this rank holds, so the caller unloads every rank with `finish_unload` once no rank is `in_use`."""
        if name in self.routers:  # a learned router: nothing runs through it once it is gone
            del self.routers[name]
            if self.swapper is not None:
                self.swapper.forget(router_node(name))
            return True
        if name not in self.served:
            raise UnknownAdapterError(name)
        dependents = sorted(r for r, router in self.routers.items() if name in router.adapters)
        if dependents:
            raise AdapterConflictError(f"adapter {name!r} is routed to by learned routers {dependents}; they "
                                       "depend on it")
        self.unloading.add(name)
        self._publish()
        if self.is_single_rank:
            self._finish_unloads()
        return name not in self.unloading

    def discard(self, name: str) -> None:
        """Release `name` now whether or not an unload was requested (undoing a load that failed on
        another rank); a no-op if it is not loaded. Raises if a live request uses it."""
        if name in self.unloading:
            self.finish_unload(name)
        elif name in self.served:
            if self.in_use(name):
                raise AdapterConflictError(f"adapter {name!r} still has live requests")
            self._release(name)
            self._publish()

    def in_use(self, name: str) -> bool:
        """A live request uses `name`: as its adapter, or through per-token LoRA routing."""
        return any(r.binding.name == name or name in r.binding.lora_names for r in self.live())

    def admitted(self, name: str) -> int:
        """Requests bound to `name` since it was loaded (0: none, or not loaded)."""
        return self._num_admitted.get(name, 0)

    def finish_unload(self, name: str) -> None:
        """Release an unloading adapter now (EP: every rank, after none is in use)."""
        if name not in self.unloading:
            raise UnknownAdapterError(name)
        if self.in_use(name):
            raise AdapterConflictError(f"adapter {name!r} still has live requests")
        self._release(name)
        self.unloading.discard(name)

    def stats(self) -> dict[str, int]:
        """LoRA slot counters, and ESFT swap counters where ESFT adapters swap (empty without)."""
        out = self.esft_disk.stats() if self.esft_disk is not None and self.esft_disk.registered else {}
        lora = self.lora
        if lora is None:
            return out
        return {**out, **lora.occupancy(),
                "swaps_in": lora.num_swaps_in, "preloads": lora.num_preloads, "evictions": lora.num_evictions,
                "hits": lora.num_hits, "misses": lora.num_misses, "swap_us": int(lora.swap_s * 1e6)}

    def describe(self) -> list[dict[str, Any]]:
        """Loaded adapters: name, slot (LoRA: None while only in host memory), kind, experts and
        bytes (ESFT), declared usage probability, state."""
        from elasticmoe.adapters.esft_slots import describe

        out = [{**d, "type": "esft"} for d in describe(self.esft)]
        if self.esft_disk is not None:  # registered beyond the slots: on disk until a request needs them
            out += [{"name": n, "slot": None, "num_experts": sum(len(v) for v in e.experts.values()),
                     "bytes_on_rank": 0, "type": "esft"}
                    for n, e in self.esft_disk.registered.items() if self.esft.index(n) is None]  # type: ignore[union-attr]
        if self.lora is not None:
            out += [{"name": n, "slot": self.lora.slot_of.get(n), "type": "lora"} for n in self.lora.names]
        for d in out:
            d["resident"] = d["slot"] is not None
        for d in out:
            if d["name"] in self.usage_probability:
                d["usage_probability"] = self.usage_probability[d["name"]]
        return [{**d, "state": "unloading" if d["name"] in self.unloading else "loaded"} for d in out]

    # ---- internals ---------------------------------------------------------------------------

    def _slots(self, adapter: str | None) -> tuple[int, int]:
        """(ESFT slot, LoRA slot) of a request for `adapter` (-1: not that kind, or a LoRA adapter
        not resident yet; None: base)."""
        if adapter is None:
            return -1, -1
        if adapter not in self.unloading:
            slot = self.esft.index(adapter) if self.esft is not None else None
            tier = self.esft_disk
            if slot is not None and (tier is None or tier.is_admitting(adapter)):
                return slot, -1
            if tier is not None and adapter in tier.registered:
                return -1, -1  # on disk, or being swapped out: it waits (`EsftDiskTier.swap_in`)
            if self.lora is not None and self.lora.is_loaded(adapter):
                slot = self.lora.index(adapter)
                if slot is None:
                    self.lora.num_misses += 1
                    return -1, -1  # it waits: swapped in before a later step (`LoraSwapper`)
                self.lora.num_hits += 1
                return -1, slot
        raise UnknownAdapterError(adapter)

    def _cache_salt(self, adapter: str | None, routing: Any, tenant_salt: str | None) -> bytes | None:
        """What a request's KV may be shared by besides its tokens (`AdapterBinding.cache_salt`): the
        weights that compute it, and the request's own `cache_salt` (a tenant's secret)."""
        if routing is not None:
            return None  # adapters mixed per token: not worth naming
        if adapter is None and tenant_salt is None:
            return b""
        load = None if adapter is None else self._load_id.get(adapter, -1)
        return json.dumps([load, adapter, tenant_salt]).encode()

    def _is_esft(self, adapter: str | None) -> bool:
        return adapter is not None and (
            (self.esft is not None and self.esft.index(adapter) is not None)
            or (self.esft_disk is not None and adapter in self.esft_disk.registered)
        )

    def _parse_routing(self, obj: Any) -> VocabRouting | LearnedRouting:
        if not isinstance(obj, dict):  # already parsed (the offline API passes a routing object)
            return obj
        if obj.get("type") != "learned":
            return VocabRouting.from_json(obj, self.model_config.vocab_size)
        router = self.routers.get(obj.get("router"))  # type: ignore[arg-type]
        if router is None:
            raise InvalidRequestError("lora_routing", f"router {obj.get('router')!r} is not loaded")
        return LearnedRouting(str(obj["router"]), router)

    def _check_new_name(self, name: str) -> None:
        if name in self.unloading:
            raise AdapterConflictError(f"adapter {name!r} is still unloading")
        if self._is_esft(name) or (self.lora is not None and self.lora.is_loaded(name)):
            raise AdapterConflictError(f"adapter {name!r} is already loaded")

    def _check_probability(self, usage_probability: float | None) -> None:
        if usage_probability is not None:
            check_probability(usage_probability)

    def _declare(self, key: str, usage_probability: float | None) -> None:
        if usage_probability is None:
            self.usage_probability.pop(key, None)
        else:
            self.usage_probability[key] = usage_probability
        if self.swapper is not None:
            self.swapper.declare(key, usage_probability)

    def _forget(self, key: str) -> None:
        self.usage_probability.pop(key, None)
        if self.swapper is not None:
            self.swapper.forget(key)

    def _note_loaded(self, name: str) -> None:
        """A new load of `name`: its own prefix-cache salt, and no request admitted yet."""
        self._load_id[name] = next(self._load_ids)
        self._num_admitted[name] = 0

    def _release(self, name: str) -> None:
        if self._is_esft(name):
            if self.esft is not None and self.esft.index(name) is not None:
                self.esft.unload(name)
            if self.esft_disk is not None:
                self.esft_disk.forget(name)
        elif self.lora is not None:
            self.lora.unload(name)
            # A router over a released adapter is dropped with it (its requests would wait forever).
            for k in [k for k, r in self.routers.items() if name in r.adapters]:
                del self.routers[k]
                self._forget(router_node(k))
        self._load_id.pop(name, None)
        self._num_admitted.pop(name, None)
        self._forget(name)

    def _publish(self) -> None:
        # NOTE: one tuple assignment, so other threads (HTTP handlers listing models) read a
        # consistent snapshot without locking the engine thread.
        esft = self.esft.names if self.esft is not None else []
        if self.esft_disk is not None:
            esft = esft + [n for n in self.esft_disk.registered if n not in esft]
        names = esft + (self.lora.names if self.lora is not None else [])
        self.served = tuple(n for n in names if n not in self.unloading)

    def _finish_unloads(self) -> None:
        live = list(self.live())
        busy = {r.binding.name for r in live}.union(*(r.binding.lora_names for r in live))
        for name in sorted(self.unloading - busy):
            self._release(name)
            self.unloading.discard(name)
