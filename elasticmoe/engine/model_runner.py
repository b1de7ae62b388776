"""Turns a scheduler output into model inputs, runs the model, returns logits.

All per-step index tensors are built here once and shared by every layer.
"""

from __future__ import annotations

import threading

import torch

from elasticmoe.adapters.lora_routing import LearnedRouting, VocabRouting
from elasticmoe.engine.expert_offload import ExpertOffload
from elasticmoe.engine.request import Request
from elasticmoe.engine.scheduler import SchedulerOutput
from elasticmoe.kernels.build import bind_threads, load_kernel, pinned_to, prebuild_all, set_kernel_threads
from elasticmoe.layers.attention import AttentionMetadata, PrefillSpan
from elasticmoe.layers.lora import LoraGroups
from elasticmoe.models.common import CausalLM, ForwardContext
from elasticmoe.utils.cpu_pressure import ThreadGovernor


class ModelRunner:
    def __init__(self, model: CausalLM, kv_pool: torch.Tensor, block_size: int, lora_topk: int = 0,
                 offload: ExpertOffload | None = None) -> None:
        self.model = model
        self.offload = offload  # expert offloading: told where each step begins
        self.kv_pool = kv_pool
        self.block_size = block_size
        self.lora_topk = lora_topk  # > 0: LoRA slots exist; every step carries K (slot, weight) per token
        self.num_threads = torch.get_num_threads()
        prebuild_all()  # compiled now (a fresh host), not in a request's forward
        # Decode steps run PyTorch's ops on this thread and only our kernels on all of them (see execute).
        self.serial_decode = self.num_threads > 1 and load_kernel("grouped_gemm") is not None
        set_kernel_threads(self.num_threads)
        # One OpenMP thread per CPU (kernels/csrc/thread_affinity.cpp), bound at the first step of
        # each thread that steps (`_bind_stepping_thread`); the stepping thread joins in per step.
        self.bound_cpus: list[int] | None = None
        self.master_cpu: int | None = None
        self._stepping_thread: int | None = None
        self.governor = ThreadGovernor(self.num_threads)  # 1 thread while other processes crowd the CPUs
        self.active_threads = self.num_threads

    def _slots(self, block_ids: list[int], start: int, end: int) -> list[int]:
        # Plain ints: per-request tensor ops cost more than the arithmetic at decode batch sizes.
        bs = self.block_size
        return [block_ids[p // bs] * bs + p % bs for p in range(start, end)]

    def _decode_metadata(self, decodes: list[Request]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Padded block tables [D, max_blocks] of the decoding sequences, their masks [D, 1, 1, K_max]
        and context lengths [D]."""
        context_lens = torch.tensor([r.num_computed_tokens + 1 for r in decodes])
        max_blocks = max(len(r.block_ids) for r in decodes)
        table = torch.tensor([r.block_ids + [0] * (max_blocks - len(r.block_ids)) for r in decodes])
        mask = torch.arange(max_blocks * self.block_size).unsqueeze(0) < context_lens.unsqueeze(1)  # [D, K_max]
        return table, mask[:, None, None, :], context_lens

    def prepare(self, sched: SchedulerOutput) -> tuple[torch.Tensor, torch.Tensor, ForwardContext, list[int]]:
        """Returns input ids [T], positions [T], the forward context, and the token
        index (into T) of each request that samples this step, in schedule order (-1: no sample)."""
        input_ids: list[int] = []
        positions: list[int] = []
        slot_mapping: list[int] = []
        sample_indices: list[int] = []
        decodes: list[Request] = []
        prefills: list[PrefillSpan] = []
        for request, n in sched.scheduled:
            start, end = request.num_computed_tokens, request.num_computed_tokens + n
            token_start = len(input_ids)
            input_ids.extend(request.token_ids[start:end])
            positions.extend(range(start, end))
            slot_mapping.extend(self._slots(request.block_ids, start, end))
            sample_indices.append(token_start + n - 1 if end == request.num_tokens else -1)
            if n == 1:
                decodes.append(request)
            else:
                span = PrefillSpan(token_start, n, end)
                if start > 0:  # chunked prefill: attend to earlier chunks in the cache too
                    span.block_table = torch.tensor(request.block_ids, dtype=torch.long)
                prefills.append(span)
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slot_mapping, dtype=torch.long),
            block_size=self.block_size,
            num_decode_tokens=len(decodes),
            prefills=prefills,
        )
        if decodes:
            meta.decode_block_table, meta.decode_mask, meta.decode_context_lens = self._decode_metadata(decodes)
        ids = torch.tensor(input_ids, dtype=torch.long)
        pos = torch.tensor(positions, dtype=torch.long)
        ctx = ForwardContext(attn=meta)
        if any(request.binding.esft_slot >= 0 for request, _ in sched.scheduled):  # base-only batches skip rerouting
            slots = torch.tensor([request.binding.esft_slot for request, _ in sched.scheduled], dtype=torch.long)
            counts = torch.tensor([n for _, n in sched.scheduled], dtype=torch.long)
            ctx.token_adapter_ids = slots.repeat_interleave(counts)
        if self.lora_topk:
            self._lora_inputs(sched, ids, ctx)
        return ids, pos, ctx, sample_indices

    def _lora_inputs(self, sched: SchedulerOutput, ids: torch.Tensor, ctx: ForwardContext) -> None:
        """Each token's K (slot, weight) pairs: its request's slot, its vocabulary range's slot, or
        (learned routing) the router's top-k over the embeddings, computed in `before_layers`."""
        k = self.lora_topk
        slots = torch.tensor([request.binding.lora_slot for request, _ in sched.scheduled], dtype=torch.long)
        counts = torch.tensor([n for _, n in sched.scheduled], dtype=torch.long)
        keys = torch.full((ids.shape[0], k), -1, dtype=torch.long)
        keys[:, 0] = slots.repeat_interleave(counts)
        weights = torch.zeros((ids.shape[0], k))
        weights[:, 0] = 1.0
        learned: list[tuple[int, int, Request]] = []
        start = 0
        for request, n in sched.scheduled:
            routing, range_slots = request.binding.routing, request.binding.range_slots
            if isinstance(routing, VocabRouting):
                assert range_slots is not None  # scheduled: every adapter it routes to is resident
                keys[start : start + n, 0] = routing.token_slots(ids[start : start + n], range_slots)
            elif isinstance(routing, LearnedRouting):
                learned.append((start, n, request))
            start += n
        ctx.token_lora_slots, ctx.token_lora_weights = keys, weights
        if not learned:
            ctx.lora_groups = LoraGroups.build(keys, weights)
            return

        def route(h: torch.Tensor) -> None:
            for first, n, request in learned:
                routing, range_slots = request.binding.routing, request.binding.range_slots
                assert range_slots is not None
                adapter, w = routing.router.route(h[first : first + n])
                top = adapter.shape[1]
                keys[first : first + n, :top] = range_slots.index_select(0, adapter.reshape(-1)).view_as(adapter)
                weights[first : first + n, :top] = w
            ctx.lora_groups = LoraGroups.build(keys, weights)

        ctx.before_layers = route

    def execute(self, sched: SchedulerOutput) -> tuple[torch.Tensor, list[int]]:
        """Run one forward pass; returns logits [N_sample, V] (float32) and the sample indices.

        A decode-only step runs PyTorch's own ops on the calling thread: at decode sizes each
        would otherwise be an OpenMP region of a few microseconds that every thread must reach
        (one preempted thread stalls it on a shared machine); the experts, the attention, the
        norms and the projections run in our kernels on every thread. While other processes
        crowd the CPUs, every step runs on one thread (`ThreadGovernor`)."""
        if self._stepping_thread != threading.get_ident():
            self._bind_stepping_thread()
        threads = self.governor.threads()
        if threads != self.active_threads:
            torch.set_num_threads(threads)
            set_kernel_threads(threads)
            self.active_threads = threads
        with pinned_to(self.master_cpu):
            if threads == 1 or not (self.serial_decode and all(n == 1 for _, n in sched.scheduled)):
                return self._execute(sched)
            torch.set_num_threads(1)
            try:
                return self._execute(sched)
            finally:
                torch.set_num_threads(threads)

    def _bind_stepping_thread(self) -> None:
        """Pin the OpenMP team of the thread that steps, at its first step.

        OpenMP keeps a thread team per thread that opens parallel regions: the team a server's
        engine thread (or a rank's loop thread) computes with is not the one of the thread that
        built the engine. Pinning the builder's team left the stepper's team unpinned, and its
        workers, created inside `pinned_to`, inherited the stepper's one CPU: both threads of a
        step then shared a core (measured: a closed loop of 64 requests on an engine thread made
        687 output tok/s against 1440 on the main thread)."""
        self._stepping_thread = threading.get_ident()
        self.bound_cpus = bind_threads(self.num_threads)
        self.master_cpu = self.bound_cpus[0] if self.bound_cpus else None

    @torch.inference_mode()
    def _execute(self, sched: SchedulerOutput) -> tuple[torch.Tensor, list[int]]:
        ids, pos, ctx, sample_indices = self.prepare(sched)
        if self.offload is not None:
            self.offload.begin_step(sched.scheduled, self.model.embed)
        hidden = self.model.forward(ids, pos, ctx, self.kv_pool)
        rows = [i for i in sample_indices if i >= 0]  # index_select below: cheaper than hidden[rows]
        if not rows:
            return hidden.new_empty((0, 0)).float(), sample_indices
        logits = self.model.compute_logits(hidden.index_select(0, torch.tensor(rows)))
        return logits, sample_indices
