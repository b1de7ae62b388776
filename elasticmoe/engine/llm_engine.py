"""The engine: requests in, token deltas out, one `step()` at a time.

Not thread-safe: one thread calls `add_request`, `abort` and `step`.
Under expert parallelism every rank of the group calls `step()` the same
number of times (a rank with no work runs an empty forward), so the MoE
collectives never hang.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from elasticmoe.adapters.lora_routing import LearnedRouting, VocabRouting
from elasticmoe.config import EngineConfig, ModelConfig
from elasticmoe.engine.adapter_manager import AdapterManager
from elasticmoe.engine.block_manager import BlockManager
from elasticmoe.engine.engine_request import AdapterRef, EngineRequest
from elasticmoe.engine.expert_offload import ExpertOffload
from elasticmoe.engine.handover import RequestSnapshot, restore, snapshot
from elasticmoe.engine.kv_cache import KVCacheSpec, KVProvider, LocalKVProvider, num_blocks_for_budget
from elasticmoe.engine.model_runner import ModelRunner
from elasticmoe.engine.offload_setup import attach_expert_offload, build_expert_offload
from elasticmoe.engine.output_processor import OutputProcessor
from elasticmoe.engine.request import Request, RequestStatus
from elasticmoe.engine.sampler import Sampler
from elasticmoe.engine.scheduler import Scheduler, SchedulerOutput
from elasticmoe.engine.structured_output import GrammarMatchers
from elasticmoe.errors import InvalidRequestError
from elasticmoe.kernels.grouped_gemm import computes_fp32_with_bf16_weights, has_grouped_gemm
from elasticmoe.models.registry import model_family
from elasticmoe.models.weights import (
    ParamSpec,
    SafetensorsWeightProvider,
    WeightProvider,
    load_weights,
    stores_as_bf16,
    with_adapter_slots,
)
from elasticmoe.outputs import RequestOutput
from elasticmoe.parallel.dispatch import AllToAllDispatcher, LocalDispatcher
from elasticmoe.parallel.expert_placement import ExpertPlacement
from elasticmoe.sampling_params import SamplingParams
from elasticmoe.tokenizer import Tokenizer
from elasticmoe.utils.cpu_features import (
    checkpoint_dtype,
    choose_compute_plan,
    cpu_compute_info,
    detect_cpu_features,
    dtype_name,
)
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
        expert_cache_pool: torch.Tensor | None = None,
        tokenizer: Tokenizer | None = None,
    ) -> None:
        """`expert_cache_pool`: with offloading, the device's expert cache buffer (the HMM's, on
        the elastic server); None: the engine allocates one of the configured budget.
        `tokenizer`: one its owner already loaded (a rank's, decode-only); None: loaded here."""
        tune_malloc()
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        self.model_config = cfg = ModelConfig.from_pretrained(config.model)
        # The dtypes this CPU computes fast; from here on config.dtype is the compute dtype.
        self.compute_plan = plan = choose_compute_plan(
            detect_cpu_features(), config.dtype, checkpoint_dtype(cfg.extra), weight_provider is not None
        )
        self.config = config = dataclasses.replace(config, dtype=plan.compute_dtype)
        logger.info("cpu compute: %s", cpu_compute_info(plan=plan))
        self.tokenizer = tokenizer or Tokenizer(config.model)
        self.placement = placement or ExpertPlacement.balanced(cfg.num_experts, config.ep_size)
        if self.placement.num_ranks != config.ep_size:
            raise ValueError(f"placement: has {self.placement.num_ranks} ranks, ep_size is {config.ep_size}")

        family = model_family(cfg.arch)
        specs = family.param_specs(cfg, self.placement.local_expert_ids(config.ep_rank))
        # ESFT: each expert stack is a virtual weight tensor [E_local + N*E_max, ...] (rows unfilled).
        specs = with_adapter_slots(specs, config.max_esft_adapters * config.max_esft_experts)
        provider = weight_provider or SafetensorsWeightProvider(config.model)
        expert_dtype = self._expert_dtype(specs, provider)
        # Offloading without a provider: the routed experts stay on disk until the cache loads them.
        on_disk = config.offloads_experts and weight_provider is None
        self.weights = load_weights([s for s in specs if not (on_disk and s.is_stacked)], provider,
                                    self._dense_dtype(specs, provider), expert_dtype)
        model_weights = self.weights
        self.offload: ExpertOffload | None = None
        if config.offloads_experts:
            self.offload, pools = build_expert_offload(config, cfg, specs, self.weights,
                                                       expert_dtype or plan.weight_dtype,
                                                       self.placement.local_expert_ids(config.ep_rank),
                                                       expert_cache_pool)
            model_weights = {**self.weights, **pools}
        dispatcher: LocalDispatcher | AllToAllDispatcher
        if config.ep_size == 1:
            dispatcher = LocalDispatcher(self.placement)
        else:
            dispatcher = AllToAllDispatcher(self.placement, config.ep_rank, ep_group)
        self.model = family.build(cfg, model_weights, dispatcher)
        self.model.compute_dtype = plan.compute_dtype
        if self.offload is not None:
            attach_expert_offload(self.model, self.offload, self.weights,
                                  len(self.placement.local_expert_ids(config.ep_rank)),
                                  esft_rows=config.max_esft_adapters * config.max_esft_experts,
                                  esft_dtype=plan.weight_dtype)
        self.kv_spec = KVCacheSpec(cfg.num_layers, config.block_size, family.kv_token_shape(cfg), plan.compute_dtype)
        num_blocks = config.num_kv_blocks or num_blocks_for_budget(self.kv_spec, config.kv_cache_bytes)
        self.kv_pool = (kv_provider or LocalKVProvider()).allocate(self.kv_spec, num_blocks)
        self.max_model_len = self._max_model_len(num_blocks)

        self.block_manager = BlockManager(num_blocks, config.block_size, prefix_caching=config.enable_prefix_caching)
        self.scheduler = Scheduler(self.block_manager, config.max_num_batched_tokens, config.max_num_seqs,
                                   window=config.scheduling_window, arranging=config.request_arranging)
        self.requests: dict[str, Request] = {}
        self.adapters = AdapterManager(self.model, self.placement, config, cfg, self.scheduler,
                                       live=lambda: self.requests.values())
        self.runner = ModelRunner(self.model, self.kv_pool, config.block_size, lora_topk=self.adapters.lora_topk,
                                  offload=self.offload)
        eos_ids = tuple(sorted(set(self.tokenizer.eos_token_ids) | set(cfg.eos_token_ids)))
        self.grammars = GrammarMatchers(self.tokenizer, self.model_config.vocab_size, eos_ids)
        self.sampler = Sampler(config.seed, eos_ids, self.grammars)
        self.output_processor = OutputProcessor(self.tokenizer, eos_ids)
        info = self.compute_info()
        logger.info(
            "engine ready: %s, computed in %s (dense weights %s, experts %s), %d KV blocks x %d tokens, "
            "max_model_len %d, ep %d/%d", cfg.arch, info["compute_dtype"], info["dense_weight_dtype"],
            info["expert_weight_dtype"], num_blocks, config.block_size, self.max_model_len, config.ep_rank,
            config.ep_size,
        )

    def _expert_dtype(self, specs: list[ParamSpec], provider: WeightProvider) -> torch.dtype | None:
        """bf16 for the expert stacks of a bf16 checkpoint computed in fp32 (lossless: every value
        is a bf16 value; half the bytes each decode step reads), where the grouped kernel computes
        fp32 x bf16 and the weights are this engine's own (a provider's memory keeps its dtype).
        ESFT adapters keep the compute dtype: their rows may be fp32 (with offloading they are
        tensors of their own, so the cache still stores bf16). None: the weight dtype."""
        esft_in_stack = self.config.max_esft_adapters and not self.config.offloads_experts
        if (self.compute_plan.compute_dtype != torch.float32 or esft_in_stack
                or not isinstance(provider, SafetensorsWeightProvider)
                or not has_grouped_gemm(torch.float32, torch.bfloat16)
                or not stores_as_bf16([s for s in specs if s.is_stacked], provider)):
            return None
        logger.info("expert weights kept in bf16 (a bf16 checkpoint, computed in fp32: exact)")
        return torch.bfloat16

    def _dense_dtype(self, specs: list[ParamSpec], provider: WeightProvider) -> torch.dtype:
        """The dtype of every weight but the expert stacks: the plan's, or bf16 for a bf16
        checkpoint computed in fp32 where the kernel multiplies fp32 activations by bf16 weights
        (`layers.linear`: AMX tiles, or widened in registers; exact weights, fp32 arithmetic). A
        decode step then reads half the bytes of every projection and the LM head (the small
        model: 15 instead of 29 MB a step), and a prefill's projections run as fast as oneDNN's
        fp32 GEMM (`computes_fp32_with_bf16_weights`)."""
        plan = self.compute_plan
        if (plan.compute_dtype == torch.float32 and isinstance(provider, SafetensorsWeightProvider)
                and computes_fp32_with_bf16_weights()
                and stores_as_bf16([s for s in specs if not s.is_stacked], provider)):
            logger.info("dense weights kept in bf16 (a bf16 checkpoint, computed in fp32: exact)")
            return torch.bfloat16
        return plan.weight_dtype

    def compute_info(self) -> dict[str, Any]:
        """`cpu_compute_info` of this engine's plan (the startup log, `/admin/status`), with the
        dtypes its weights are held in: a bf16 checkpoint computed in fp32 keeps bf16 weights where
        the kernel computes with them, and a provider's weights keep the provider's dtype."""
        blocks = self.model.moe_blocks()
        return {**cpu_compute_info(plan=self.compute_plan),
                "dense_weight_dtype": dtype_name(self.model.embed.dtype),
                "expert_weight_dtype": dtype_name(blocks[0].w13.dtype) if blocks else None}

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
        if request_id in self.requests:
            raise InvalidRequestError("request_id", f"request {request_id!r} is already running")
        token_ids = self._prompt_token_ids(request.prompt)
        output_ids = self._resumed_output_ids(request)
        vocab = self.model_config.vocab_size
        params.check_vocabulary(vocab)
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
        state = Request(request_id, token_ids + output_ids, len(token_ids), params, self.max_model_len)
        if state.generator is not None and not params.is_greedy:
            Sampler.replay(state.generator, len(output_ids), vocab)
        self.grammars.attach(state)
        self.adapters.bind(state, request.adapter)  # last check: raises before anything is kept
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
        # The pool may have another owner from now on, who writes into the blocks free here.
        self.block_manager.forget_cached()
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
        token is recomputed; otherwise, or where a request's adapter is not resident
        here, their KV is recomputed from their tokens."""
        if kv_is_shared:  # the exporter wrote into this pool: blocks free here may hold its KV now
            self.block_manager.forget_cached()
        restored: list[tuple[RequestSnapshot, Request]] = []
        seen: set[str] = set()
        for snap in snaps:
            if snap.request_id in self.requests or snap.request_id in seen:
                raise InvalidRequestError("request_id", f"request {snap.request_id!r} is already here")
            seen.add(snap.request_id)
            request = restore(snap, keep_kv=kv_is_shared)
            self.grammars.attach(request)
            self.adapters.rebind(request)
            if request.block_ids and not request.is_ready:
                # Its adapter is not resident here (another took the slot): it waits for the swap-in
                # and its KV is recomputed then, as it would run on the base model if it ran on now.
                request.block_ids, request.num_computed_tokens = [], 0
            restored.append((snap, request))
        # One claim for all: requests of one prefix share its cached blocks.
        self.block_manager.claim_tables([r.block_ids for _, r in restored if r.block_ids])
        for snap, request in restored:
            if request.block_ids:
                self.block_manager.cache_full_blocks(request)  # its KV is this pool's: others may share it
                request.status = RequestStatus.RUNNING
                self.scheduler.running.append(request)
            else:
                self.scheduler.waiting.append(request)
            self.requests[request.request_id] = request
            self.output_processor.restore(request, snap)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    def expert_load(self) -> np.ndarray:
        """Tokens this engine routed to each expert, `[MoE layers, experts]` (global expert ids; under
        EP each rank counts its own tokens, so the ranks' counts add up)."""
        blocks = self.model.moe_blocks()
        rows = [b.routed_tokens.numpy().copy() if b.routed_tokens is not None
                else np.zeros(self.model_config.num_experts, dtype=np.int64) for b in blocks]
        return np.stack(rows) if rows else np.zeros((0, self.model_config.num_experts), dtype=np.int64)

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
        failed = [self._fail(r, exc) for r, exc in self.adapters.before_step()]  # an adapter unreadable
        sched = self.scheduler.schedule()
        if sched.is_empty and self.adapters.wait_for_swap():
            sched = self.scheduler.schedule()
        if sched.is_empty and self.config.ep_size == 1:
            return failed  # NOTE: under EP an idle rank still runs the empty forward (lockstep)
        try:
            logits, sample_indices = self.runner.execute(sched)
        except Exception:
            if self.config.ep_size > 1:
                raise
            logger.exception("forward of %d requests failed; running them one by one", len(sched.scheduled))
            outputs = self._execute_one_by_one(sched)
        else:
            outputs = self._update(sched, logits, sample_indices)
            self.adapters.after_step()
        if self.offload is not None:
            self.offload.end_step(self.requests.keys())
        return failed + outputs

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
            self.block_manager.cache_full_blocks(request)
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
                complete = self.grammars.advance(request, token_id)
                finished = self.output_processor.append_token(request, token_id, logprob, complete)
                output = self.output_processor.make_output(request, finished)
            except Exception as exc:  # noqa: BLE001 - e.g. a detokenizer or grammar error of this request
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

    def close(self) -> None:
        """Stop the engine's own threads (the expert prefetcher). Idempotent; the engine must not
        step afterwards."""
        if self.offload is not None:
            self.offload.close()

    def _forget(self, request: Request) -> None:
        self.scheduler.finish(request)
        self.requests.pop(request.request_id, None)
        self.output_processor.remove(request.request_id)
