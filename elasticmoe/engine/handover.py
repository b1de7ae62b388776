"""Handing running sequences from one engine to another at a step boundary.

At a switchover the old instance stops between steps and exports each live
request: its tokens, sampling state (params, seeded generator state), text
state (detokenizer window, emitted counts) and, where the KV pool is shared
with the new engine (a device kept across the scale), its block table. The new
engine imports them: with the block table it continues without recomputation;
without it the request is requeued with its tokens kept and its KV recomputed.
Streams continue where they stopped: nothing already emitted is emitted again.

Snapshots are plain picklable data, so they can cross process boundaries.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from elasticmoe.engine.request import AdapterBinding, Request, RequestStatus
from elasticmoe.sampling_params import SamplingParams


@dataclass(frozen=True, slots=True)
class RequestSnapshot:
    request_id: str
    token_ids: tuple[int, ...]
    num_prompt_tokens: int
    params: SamplingParams
    max_total_tokens: int
    arrival_time: float
    num_computed_tokens: int
    block_ids: tuple[int, ...]  # empty when the request was waiting or holds no KV
    was_running: bool
    generator_state: torch.Tensor | None
    # Text side (see OutputProcessor): detokenizer window and what the stream has seen.
    detok_ids: tuple[int, ...]
    detok_read_offset: int
    text: str
    num_emitted_chars: int
    num_emitted_tokens: int
    adapter: str | None = None  # ESFT adapter; the importing engine must have it loaded
    lora_routing: Any = None  # per-token LoRA routing (a `VocabRouting`), if any
    num_cached_tokens: int | None = None  # what its first admission found in the prefix cache


def snapshot(request: Request, text_state) -> RequestSnapshot:
    detok = text_state.detokenizer
    return RequestSnapshot(
        request_id=request.request_id,
        token_ids=tuple(request.token_ids),
        num_prompt_tokens=request.num_prompt_tokens,
        params=request.params,
        max_total_tokens=request.max_total_tokens,
        arrival_time=request.arrival_time,
        num_computed_tokens=request.num_computed_tokens,
        block_ids=tuple(request.block_ids),
        was_running=request.status == RequestStatus.RUNNING,
        generator_state=request.generator.get_state() if request.generator is not None else None,
        detok_ids=tuple(detok.ids[detok.prefix_offset :]),
        detok_read_offset=detok.read_offset - detok.prefix_offset,
        text=text_state.text,
        num_emitted_chars=text_state.num_emitted_chars,
        num_emitted_tokens=text_state.num_emitted_tokens,
        adapter=request.binding.name,
        lora_routing=request.binding.routing,
        num_cached_tokens=request.num_cached_tokens,
    )


def restore(snap: RequestSnapshot, keep_kv: bool) -> Request:
    """A request object for the importing engine; KV kept only if `keep_kv` and it had blocks."""
    request = Request(
        snap.request_id, list(snap.token_ids), snap.num_prompt_tokens, snap.params, snap.max_total_tokens,
        arrival_time=snap.arrival_time, binding=AdapterBinding(snap.adapter, routing=snap.lora_routing),
        num_cached_tokens=snap.num_cached_tokens,
    )
    if snap.generator_state is not None and request.generator is not None:
        request.generator.set_state(snap.generator_state)
    if keep_kv and snap.was_running and snap.block_ids:
        request.num_computed_tokens = snap.num_computed_tokens
        request.block_ids = list(snap.block_ids)
    return request
