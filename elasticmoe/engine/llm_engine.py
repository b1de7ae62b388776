"""The engine: requests in, token deltas out, one `step()` at a time.

Not thread-safe: one thread calls `add_request`, `abort` and `step`.
Under expert parallelism every rank of the group calls `step()` the same
number of times (a rank with no work runs an empty forward), so the MoE
collectives never hang.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
import torch.distributed as dist

from elasticmoe.adapters.esft_slots import AdapterConflictError, AdapterLimitError, EsftSlots, ExpertWeights
from elasticmoe.adapters.lora_router import LoraRouter
from elasticmoe.adapters.lora_routing import LearnedRouting, VocabRouting
from elasticmoe.adapters.lora_slots import LoraSlots, LoraWeights
from elasticmoe.config import EngineConfig, ModelConfig
from elasticmoe.engine.block_manager import BlockManager
from elasticmoe.engine.engine_request import AdapterRef, EngineRequest
from elasticmoe.engine.handover import RequestSnapshot, restore, snapshot
from elasticmoe.engine.kv_cache import KVCacheSpec, KVProvider, LocalKVProvider, num_blocks_for_budget
from elasticmoe.engine.lora_swapper import LoraSwapper
from elasticmoe.engine.model_runner import ModelRunner
from elasticmoe.engine.output_processor import OutputProcessor
from elasticmoe.engine.request import LORA_PENDING, Request, RequestStatus
from elasticmoe.engine.sampler import Sampler
from elasticmoe.engine.scheduler import Scheduler, SchedulerOutput
from elasticmoe.errors import InvalidRequestError, UnknownAdapterError
from elasticmoe.models.registry import model_family
from elasticmoe.models.weights import (
    SafetensorsWeightProvider,
    WeightProvider,
    load_weights,
    with_adapter_slots,
)
from elasticmoe.outputs import RequestOutput
from elasticmoe.parallel.dispatch import AllToAllDispatcher, LocalDispatcher
from elasticmoe.parallel.expert_placement import ExpertPlacement
from elasticmoe.sampling_params import SamplingParams
from elasticmoe.tokenizer import Tokenizer
from elasticmoe.utils.malloc import tune_malloc

logger = logging.getLogger(__name__)


class LLMEngine:
    def __init__(
        self,
        config: EngineConfig,
        weight_provider: WeightProvider | None = None,
        kv_provider: KVProvider | None = None,
        placement: ExpertPlacement | None = None,
        ep_group: dist.ProcessGroup | None = None,
    ) -> None:
        self.config = config
        tune_malloc()
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        self.model_config = cfg = ModelConfig.from_pretrained(config.model)
        self.tokenizer = Tokenizer(config.model)
        self.placement = placement or ExpertPlacement.balanced(cfg.num_experts, config.ep_size)
        if self.placement.num_ranks != config.ep_size:
            raise ValueError(f"placement: has {self.placement.num_ranks} ranks, ep_size is {config.ep_size}")

        family = model_family(cfg.arch)
        specs = family.param_specs(cfg, self.placement.local_expert_ids(config.ep_rank))
        # ESFT: each expert stack is a virtual weight tensor [E_local + N*E_max, ...] (rows unfilled).
        specs = with_adapter_slots(specs, config.max_esft_adapters * config.max_esft_experts)
        provider = weight_provider or SafetensorsWeightProvider(config.model)
        self.weights = load_weights(specs, provider, config.dtype)
        dispatcher: LocalDispatcher | AllToAllDispatcher
        if config.ep_size == 1:
            dispatcher = LocalDispatcher(self.placement)
        else:
            dispatcher = AllToAllDispatcher(self.placement, config.ep_rank, ep_group)
        self.model = family.build(cfg, self.weights, dispatcher)
        self.esft: EsftSlots | None = None
        if config.max_esft_adapters:
            self.esft = EsftSlots(self.model, self.placement, config.ep_rank, config.max_esft_adapters,
                                  config.max_esft_experts)
        self.lora: LoraSlots | None = None
        if config.max_loras:
            # NOTE: under EP a slot's expert factors serve every rank's tokens, so slots cannot be
            # swapped per rank: there, every loaded adapter stays resident (no host-only adapters).
            cached = config.max_cpu_loras if config.ep_size == 1 else config.max_loras
            self.lora = LoraSlots(self.model, self.placement, config.ep_rank, config.max_loras,
                                  config.max_lora_rank, config.dtype, max_cached=cached, top_k=config.max_lora_topk)
        self.lora_routers: dict[str, LoraRouter] = {}
        self.unloading_adapters: set[str] = set()
        self.served_adapters: tuple[str, ...] = ()  # loaded adapters that accept requests

        self.kv_spec = KVCacheSpec(cfg.num_layers, config.block_size, family.kv_token_shape(cfg), config.dtype)
        num_blocks = config.num_kv_blocks or num_blocks_for_budget(self.kv_spec, config.kv_cache_bytes)
        self.kv_pool = (kv_provider or LocalKVProvider()).allocate(self.kv_spec, num_blocks)
        self.max_model_len = self._max_model_len(num_blocks)

        self.block_manager = BlockManager(num_blocks, config.block_size)
        self.scheduler = Scheduler(self.block_manager, config.max_num_batched_tokens, config.max_num_seqs,
                                   window=config.scheduling_window)
        self.lora_swapper = (LoraSwapper(self.lora, self.scheduler, can_swap_async=config.ep_size == 1)
                             if self.lora is not None else None)
        self.runner = ModelRunner(self.model, self.kv_pool, config.block_size,
                                  lora_topk=config.max_lora_topk if self.lora is not None else 0)
        self.sampler = Sampler(config.seed)
        eos_ids = tuple(sorted(set(self.tokenizer.eos_token_ids) | set(cfg.eos_token_ids)))
        self.output_processor = OutputProcessor(self.tokenizer, eos_ids)
        self.requests: dict[str, Request] = {}
        logger.info(
            "engine ready: %s, %s, %d KV blocks x %d tokens, max_model_len %d, ep %d/%d",
            cfg.arch, config.dtype, num_blocks, config.block_size, self.max_model_len, config.ep_rank, config.ep_size,
        )

    def _max_model_len(self, num_blocks: int) -> int:
        limit = self.config.max_model_len or self.model_config.max_position_embeddings
        limit = min(limit, self.model_config.max_position_embeddings)
        capacity = num_blocks * self.config.block_size
        if capacity < limit:
            # A request longer than the pool could never be scheduled; refuse it up front instead.
            logger.warning("KV pool holds %d tokens: max_model_len lowered from %d", capacity, limit)
            limit = capacity
        return limit

    # ---- requests -------------------------------------------------------------------

    def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams,
        adapter: str | None = None,
        lora_routing: VocabRouting | LearnedRouting | dict | None = None,
    ) -> None:
        """`add` with the request's fields as arguments (the offline API and tests)."""
        self.add(EngineRequest(request_id, prompt, params, AdapterRef(adapter, lora_routing)))  # type: ignore[arg-type]

    def add(self, request: EngineRequest) -> None:
        """Queue a request for its adapter (ESFT or LoRA; None: the base model), or with its tokens
        routed to LoRA adapters per token (`adapter.routing`: by vocabulary range or a learned
        router); with `resume`, continuing after the output tokens its client already has.
        Raises `InvalidRequestError` (a ValueError naming the field; `UnknownAdapterError` for an
        adapter not loaded); nothing is kept then."""
        request_id, params = request.request_id, request.params
        adapter, lora_routing = request.adapter.name, request.adapter.routing
        if request_id in self.requests:
            raise InvalidRequestError("request_id", f"request {request_id!r} is already running")
        slot, lora_slot = self._adapter_slots(adapter)
        routing = self._parse_routing(lora_routing) if isinstance(lora_routing, dict) else lora_routing
        if routing is not None:
            missing = [n for n in routing.names if self.lora is None or not self.lora.is_loaded(n)
                       or n in self.unloading_adapters]
            if missing:
                raise UnknownAdapterError(missing[0])
        token_ids = self._prompt_token_ids(request.prompt)
        output_ids = self._resumed_output_ids(request)
        vocab = self.model_config.vocab_size
        if any(t >= vocab for t in params.stop_token_ids):
            raise InvalidRequestError("stop_token_ids", f"token ids must be < vocab size {vocab}")
        if len(token_ids) >= self.max_model_len:
            raise InvalidRequestError(
                "prompt", f"prompt has {len(token_ids)} tokens; the maximum context length is {self.max_model_len}"
            )
        if params.max_tokens is not None and len(token_ids) + params.max_tokens > self.max_model_len:
            raise InvalidRequestError(
                "max_tokens",
                f"prompt ({len(token_ids)} tokens) + max_tokens ({params.max_tokens}) exceeds the maximum "
                f"context length {self.max_model_len}",
            )
        state = Request(request_id, token_ids + output_ids, len(token_ids), params, self.max_model_len,
                        adapter=adapter, adapter_slot=slot, lora_slot=lora_slot, lora_routing=routing)
        if state.generator is not None and not params.is_greedy:
            Sampler.replay(state.generator, len(output_ids), vocab)
        if self.lora_swapper is not None:
            if routing is not None:
                self.lora_swapper.assign(state)
            if lora_slot != -1 and adapter is not None:
                self.lora_swapper.note_arrival(adapter)
        self.requests[request_id] = state
        self.output_processor.add(state)
        if request.resume is not None:
            self.output_processor.resume(state, request.resume.num_emitted_chars)
        self.scheduler.add(state)

    def _resumed_output_ids(self, request: EngineRequest) -> list[int]:
        """The output tokens a resumed request's client already has (checked like a prompt)."""
        if request.resume is None:
            return []
        ids = list(request.resume.output_token_ids)
        if not all(isinstance(t, int) and 0 <= t < self.model_config.vocab_size for t in ids):
            raise InvalidRequestError("resume", f"output token ids must be in [0, {self.model_config.vocab_size})")
        limit = request.params.max_tokens
        if limit is not None and len(ids) >= limit:
            raise InvalidRequestError("resume", f"{len(ids)} output tokens already reach max_tokens {limit}")
        return ids

    def _adapter_slots(self, adapter: str | None) -> tuple[int, int]:
        """(ESFT slot, LoRA slot) of a request for `adapter` (-1: not that kind; None: base)."""
        if adapter is None:
            return -1, -1
        if adapter not in self.unloading_adapters:
            slot = self.esft.index(adapter) if self.esft is not None else None
            if slot is not None:
                return slot, -1
            if self.lora is not None and self.lora.is_loaded(adapter):
                slot = self.lora.index(adapter)
                if slot is None:
                    self.lora.num_misses += 1
                    return -1, LORA_PENDING  # swapped in before a later step (`LoraSwapper`)
                self.lora.num_hits += 1
                return -1, slot
        raise UnknownAdapterError(adapter)

    # ---- ESFT adapters --------------------------------------------------------------

    def load_esft_adapter(
        self,
        name: str,
        experts: dict[int, tuple[int, ...]],
        expert_weights: ExpertWeights | None,
        slot: int | None = None,
    ) -> int:
        """Load an ESFT adapter (its tuned experts that live on this rank) into slot `slot` (None:
        a free one). `expert_weights=None`: the provider already filled its rows (HMM memory).
        Raises `AdapterLimitError` / `AdapterConflictError` (409) or `ValueError` naming the field."""
        if self.esft is None:
            raise AdapterLimitError("this engine serves no ESFT adapters (--max-esft-adapters 0)")
        self._check_new_name(name)
        slot = self.esft.load(name, experts, expert_weights, slot)
        self._publish_adapter_names()
        return slot

    def load_lora_adapter(
        self,
        name: str,
        modules: dict[str, tuple[int, int, int]],
        weights: LoraWeights,
        scaling: float,
        slot: int | None = None,
    ) -> int | None:
        """Load a LoRA adapter (`modules`: base module path -> (r, in, out); `weights(path, dtype)`
        -> (A, B)) into host memory and LoRA slot `slot` (None: a free one if any; returns None
        when it waits in host memory until a request needs it). Under EP only this rank's
        experts' factors are kept. Raises `AdapterLimitError` / `AdapterConflictError` (409) or
        `ValueError` naming the field."""
        if self.lora is None:
            raise AdapterLimitError("this engine serves no LoRA adapters (--max-loras 0)")
        self._check_new_name(name)
        slot = self.lora.load(name, modules, weights, scaling, slot)
        self._publish_adapter_names()
        return slot

    def _parse_routing(self, obj: dict) -> VocabRouting | LearnedRouting:
        if obj.get("type") != "learned":
            return VocabRouting.from_json(obj, self.model_config.vocab_size)
        router = self.lora_routers.get(obj.get("router"))  # type: ignore[arg-type]
        if router is None:
            raise InvalidRequestError("lora_routing", f"router {obj.get('router')!r} is not loaded")
        return LearnedRouting(str(obj["router"]), router)

    def load_lora_router(self, name: str, router: LoraRouter) -> None:
        """Register a learned router (MoLoRA §4.3) over loaded LoRA adapters; requests pick it
        with `lora_routing={"type": "learned", "router": name}`."""
        if self.lora is None:
            raise AdapterLimitError("this engine serves no LoRA adapters (--max-loras 0)")
        if router.top_k > self.config.max_lora_topk:
            raise AdapterLimitError(f"router top_k {router.top_k} > {self.config.max_lora_topk} (max_lora_topk)")
        missing = [a for a in router.adapters if not self.lora.is_loaded(a)]
        if missing:
            raise UnknownAdapterError(missing[0])
        if router.w1.shape[1] != self.model_config.hidden_size:
            raise ValueError(f"path: router input size {router.w1.shape[1]} != hidden size "
                             f"{self.model_config.hidden_size}")
        self.lora_routers[name] = router

    def lora_stats(self) -> dict[str, int]:
        lora = self.lora
        if lora is None:
            return {}
        return {"slots": lora.max_loras, "resident": len(lora.slot_of), "loaded": len(lora.host),
                "swaps_in": lora.num_swaps_in, "evictions": lora.num_evictions,
                "hits": lora.num_hits, "misses": lora.num_misses}

    def _check_new_name(self, name: str) -> None:
        if name in self.unloading_adapters:
            raise AdapterConflictError(f"adapter {name!r} is still unloading")
        if (self.esft is not None and self.esft.index(name) is not None) or (
            self.lora is not None and self.lora.is_loaded(name)
        ):
            raise AdapterConflictError(f"adapter {name!r} is already loaded")

    def _release(self, name: str) -> None:
        if self.esft is not None and self.esft.index(name) is not None:
            self.esft.unload(name)
        elif self.lora is not None:
            self.lora.unload(name)
            # A router over a released adapter is dropped with it (its requests would wait forever).
            self.lora_routers = {k: r for k, r in self.lora_routers.items() if name not in r.adapters}

    def unload_adapter(self, name: str) -> bool:
        """Stop admitting requests for `name`. With one rank it is unloaded (its rows released)
        once none of its requests is live, now or at the end of a later step; returns True if
        that happened now. Under EP other ranks route tokens to the experts this rank holds, so
        the caller unloads every rank with `finish_adapter_unload` once no rank `adapter_in_use`."""
        if name not in self.served_adapters:
            raise UnknownAdapterError(name)
        self.unloading_adapters.add(name)
        self._publish_adapter_names()
        if self.config.ep_size == 1:
            self._finish_unloads()
        return name not in self.unloading_adapters

    def discard_adapter(self, name: str) -> None:
        """Release `name` now whether or not an unload was requested (undoing a load that failed on
        another rank); a no-op if it is not loaded. Raises if a live request uses it."""
        if name in self.unloading_adapters:
            self.finish_adapter_unload(name)
        elif name in self.served_adapters:
            if self.adapter_in_use(name):
                raise AdapterConflictError(f"adapter {name!r} still has live requests")
            self._release(name)
            self._publish_adapter_names()

    def adapter_in_use(self, name: str) -> bool:
        """A live request uses `name`: as its adapter, or through per-token LoRA routing."""
        return any(r.adapter == name or name in LoraSwapper.names(r) for r in self.requests.values())

    def finish_adapter_unload(self, name: str) -> None:
        """Release an unloading adapter now (EP: every rank, after none is in use)."""
        if name not in self.unloading_adapters:
            raise UnknownAdapterError(name)
        if self.adapter_in_use(name):
            raise AdapterConflictError(f"adapter {name!r} still has live requests")
        self._release(name)
        self.unloading_adapters.discard(name)

    def _publish_adapter_names(self) -> None:
        # NOTE: one tuple assignment, so other threads (HTTP handlers listing models) read a
        # consistent snapshot without locking the engine thread.
        names = (self.esft.names if self.esft is not None else []) + (self.lora.names if self.lora is not None else [])
        self.served_adapters = tuple(n for n in names if n not in self.unloading_adapters)

    def _finish_unloads(self) -> None:
        busy = {r.adapter for r in self.requests.values()}.union(*(LoraSwapper.names(r) for r in self.requests.values()))
        for name in sorted(self.unloading_adapters - busy):
            self._release(name)
            self.unloading_adapters.discard(name)

    def _prompt_token_ids(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            token_ids = self.tokenizer.encode(prompt)
        elif isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            token_ids = list(prompt)
            if any(not 0 <= t < self.model_config.vocab_size for t in token_ids):
                raise InvalidRequestError("prompt", f"token ids must be in [0, {self.model_config.vocab_size})")
        else:
            raise InvalidRequestError("prompt", "must be a string or a list of token ids")
        if not token_ids:
            raise InvalidRequestError("prompt", "must not be empty")
        return token_ids

    def abort(self, request_id: str) -> None:
        """Drop a request and free its KV blocks; unknown ids are ignored."""
        request = self.requests.get(request_id)
        if request is not None:
            self._forget(request)

    def export_requests(self, hand_over_kv: bool) -> list[RequestSnapshot]:
        """Remove every live request from this engine and return its state, running ones first.

        Call between steps (the engine is single-threaded, so any call site is a
        step boundary). With `hand_over_kv` the block tables travel with the
        snapshots and the blocks stay allocated: the pool's next owner claims
        them. Otherwise the blocks are freed here.
        """
        requests = list(self.scheduler.running) + list(self.scheduler.waiting)
        snaps = [snapshot(r, self.output_processor.states[r.request_id]) for r in requests]
        for request in requests:
            if hand_over_kv:
                request.block_ids = []  # ownership moves with the snapshot; do not free
            self.scheduler.finish(request)
            self.requests.pop(request.request_id, None)
            self.output_processor.remove(request.request_id)
        return snaps

    def import_requests(self, snaps: list[RequestSnapshot], kv_is_shared: bool) -> None:
        """Continue handed-over requests. `kv_is_shared`: this engine's KV pool is the
        exporter's (same device, same pool), so block tables stay valid and no
        token is recomputed; otherwise their KV is recomputed from their tokens."""
        for snap in snaps:
            if snap.request_id in self.requests:
                raise InvalidRequestError("request_id", f"request {snap.request_id!r} is already here")
            request = restore(snap, keep_kv=kv_is_shared)
            request.adapter_slot, request.lora_slot = self._adapter_slots(snap.adapter)  # loaded here too
            if request.lora_routing is not None and self.lora_swapper is not None:
                self.lora_swapper.assign(request)
            if request.block_ids:
                self.block_manager.claim(request.block_ids)
                request.status = RequestStatus.RUNNING
                self.scheduler.running.append(request)
            else:
                self.scheduler.waiting.append(request)
            self.requests[request.request_id] = request
            self.output_processor.restore(request, snap)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    # ---- the step ---------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """schedule -> execute -> update. Returns outputs of requests that made progress.

        A request whose forward or sampling raises is finished alone (`finish_reason="error"`),
        the others go on. Under EP a failed forward raises instead: the peers may be inside
        its all-to-all, so the instance is replaced (the coordinator resumes its requests)."""
        swapper = self.lora_swapper
        if swapper is not None:
            swapper.swap_in()
        sched = self.scheduler.schedule()
        if sched.is_empty and swapper is not None and swapper.lora.filling and self.config.ep_size == 1:
            # Nothing can run until an adapter arrives: wait for its copy instead of spinning.
            swapper.lora.wait_for_a_swap()
            swapper.swap_in()
            sched = self.scheduler.schedule()
        if sched.is_empty and self.config.ep_size == 1:
            return []
        try:
            logits, sample_indices = self.runner.execute(sched)
        except Exception:
            if self.config.ep_size > 1:
                raise
            logger.exception("forward of %d requests failed; running them one by one", len(sched.scheduled))
            return self._execute_one_by_one(sched)
        outputs = self._update(sched, logits, sample_indices)
        if self.unloading_adapters and self.config.ep_size == 1:
            self._finish_unloads()
        return outputs

    def _execute_one_by_one(self, sched: SchedulerOutput) -> list[RequestOutput]:
        """After a failed batched forward: each request's share alone, so that only the requests
        whose own forward raises fail (re-running writes the same KV slots again)."""
        outputs = []
        for request, n in sched.scheduled:
            single = SchedulerOutput(scheduled=[(request, n)])
            try:
                logits, sample_indices = self.runner.execute(single)
            except Exception as exc:  # noqa: BLE001 - this request's own failure
                outputs.append(self._fail(request, exc))
                continue
            outputs += self._update(single, logits, sample_indices)
        return outputs

    def _update(self, sched: SchedulerOutput, logits: torch.Tensor, sample_indices: list[int]) -> list[RequestOutput]:
        sampling = [r for (r, _), i in zip(sched.scheduled, sample_indices, strict=True) if i >= 0]
        for request, n in sched.scheduled:
            request.num_computed_tokens += n
        if not sampling:
            return []
        outputs = []
        for request, sampled in zip(sampling, self._sample(logits, sampling), strict=True):
            if isinstance(sampled, Exception):
                outputs.append(self._fail(request, sampled))
                continue
            token_id, logprob = sampled
            request.token_ids.append(token_id)
            try:
                finished = self.output_processor.append_token(request, token_id, logprob)
                output = self.output_processor.make_output(request, finished)
            except Exception as exc:  # noqa: BLE001 - e.g. a detokenizer error on this request's text
                outputs.append(self._fail(request, exc))
                continue
            outputs.append(output)
            if finished:
                self._forget(request)
        return outputs

    def _sample(self, logits: torch.Tensor, requests: list[Request]) -> list[tuple[int, Any] | Exception]:
        """(token, logprob) per row; if the batch raises, row by row, so only the rows whose own
        parameters raise carry the exception."""
        try:
            result = self.sampler(logits, requests)
            return list(zip(result.token_ids, result.logprobs, strict=True))
        except Exception:
            logger.exception("sampling %d rows failed; sampling them one by one", len(requests))
        rows: list[tuple[int, Any] | Exception] = []
        for i, request in enumerate(requests):
            try:
                one = self.sampler(logits[i : i + 1], [request])
                rows.append((one.token_ids[0], one.logprobs[0]))
            except Exception as exc:  # noqa: BLE001 - this row's own failure
                rows.append(exc)
        return rows

    def _fail(self, request: Request, exc: BaseException) -> RequestOutput:
        """Finish `request` with `finish_reason="error"` (its blocks freed); the engine goes on."""
        logger.error("request %s failed in the engine: %r", request.request_id, exc)
        output = self.output_processor.make_output(request, finished=True, finish_reason="error")
        output.error = f"{type(exc).__name__}: {exc}"
        self._forget(request)
        return output

    def fail_all(self, exc: BaseException) -> list[RequestOutput]:
        """Finish every live request with `finish_reason="error"` (after a step that raised past the
        per-request isolation: the engine's state is no longer trusted for them)."""
        outputs = []
        for request in list(self.requests.values()):
            try:
                outputs.append(self._fail(request, exc))
            except Exception:  # noqa: BLE001 - its text state is broken too: drop it quietly
                logger.exception("request %s: failing it raised", request.request_id)
                self._forget(request)
                outputs.append(RequestOutput(request.request_id, request.prompt_token_ids, [], "",
                                             request.output_token_ids, "", finished=True,
                                             finish_reason="error", error=f"{type(exc).__name__}: {exc}"))
        return outputs

    def _forget(self, request: Request) -> None:
        self.scheduler.finish(request)
        self.requests.pop(request.request_id, None)
        self.output_processor.remove(request.request_id)
