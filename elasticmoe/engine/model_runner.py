"""Turns a scheduler output into model inputs, runs the model, returns logits.

All per-step index tensors are built here once and shared by every layer.
"""

from __future__ import annotations

import torch

from elasticmoe.engine.request import Request
from elasticmoe.engine.scheduler import SchedulerOutput
from elasticmoe.layers.attention import AttentionMetadata, PrefillSpan
from elasticmoe.layers.lora import LoraGroups
from elasticmoe.models.common import CausalLM, ForwardContext


class ModelRunner:
    def __init__(self, model: CausalLM, kv_pool: torch.Tensor, block_size: int, lora: bool = False) -> None:
        self.model = model
        self.kv_pool = kv_pool
        self.block_size = block_size
        self.lora = lora  # LoRA slots exist: every step carries the tokens' LoRA slots

    def _slots(self, block_ids: list[int], start: int, end: int) -> list[int]:
        # Plain ints: per-request tensor ops cost more than the arithmetic at decode batch sizes.
        bs = self.block_size
        return [block_ids[p // bs] * bs + p % bs for p in range(start, end)]

    def _decode_metadata(self, decodes: list[Request]) -> tuple[torch.Tensor, torch.Tensor]:
        """Padded block tables [D, max_blocks] of the decoding sequences and their masks [D, 1, 1, K_max]."""
        context_lens = torch.tensor([r.num_computed_tokens + 1 for r in decodes])
        max_blocks = max(len(r.block_ids) for r in decodes)
        table = torch.tensor([r.block_ids + [0] * (max_blocks - len(r.block_ids)) for r in decodes])
        mask = torch.arange(max_blocks * self.block_size).unsqueeze(0) < context_lens.unsqueeze(1)  # [D, K_max]
        return table, mask[:, None, None, :]

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
                    q_pos = torch.arange(start, end).unsqueeze(1)
                    key_pos = torch.arange(len(request.block_ids) * self.block_size).unsqueeze(0)
                    span.mask = (key_pos <= q_pos)[None, None]
                prefills.append(span)
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slot_mapping, dtype=torch.long),
            block_size=self.block_size,
            num_decode_tokens=len(decodes),
            prefills=prefills,
        )
        if decodes:
            meta.decode_block_table, meta.decode_mask = self._decode_metadata(decodes)
        ids = torch.tensor(input_ids, dtype=torch.long)
        pos = torch.tensor(positions, dtype=torch.long)
        ctx = ForwardContext(attn=meta)
        if any(request.adapter_slot >= 0 for request, _ in sched.scheduled):  # base-only batches skip rerouting
            slots = torch.tensor([request.adapter_slot for request, _ in sched.scheduled], dtype=torch.long)
            counts = torch.tensor([n for _, n in sched.scheduled], dtype=torch.long)
            ctx.token_adapter_ids = slots.repeat_interleave(counts)
        if self.lora:
            slots = torch.tensor([request.lora_slot for request, _ in sched.scheduled], dtype=torch.long)
            counts = torch.tensor([n for _, n in sched.scheduled], dtype=torch.long)
            token_slots = slots.repeat_interleave(counts)
            if any(request.lora_routing is not None for request, _ in sched.scheduled):
                token_slots = self._per_token_slots(sched, ids, token_slots)
            ctx.token_lora_slots = token_slots
            ctx.lora_groups = LoraGroups.build(token_slots)
        return ids, pos, ctx, sample_indices

    @staticmethod
    def _per_token_slots(sched: SchedulerOutput, ids: torch.Tensor, token_slots: torch.Tensor) -> torch.Tensor:
        """Overwrite the tokens of vocabulary-routed requests with their ranges' slots."""
        start = 0
        for request, n in sched.scheduled:
            if request.lora_routing is not None:
                token_slots[start : start + n] = request.lora_routing.token_slots(
                    ids[start : start + n], request.lora_range_slots
                )
            start += n
        return token_slots

    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput) -> tuple[torch.Tensor, list[int]]:
        """Run one forward pass; returns logits [N_sample, V] (float32) and the sample indices."""
        ids, pos, ctx, sample_indices = self.prepare(sched)
        hidden = self.model.forward(ids, pos, ctx, self.kv_pool)
        rows = [i for i in sample_indices if i >= 0]  # index_select below: cheaper than hidden[rows]
        if not rows:
            return hidden.new_empty((0, 0)).float(), sample_indices
        logits = self.model.compute_logits(hidden.index_select(0, torch.tensor(rows)))
        return logits, sample_indices
