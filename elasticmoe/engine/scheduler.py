"""Continuous batching under a token budget, with chunked prefill and preemption.

Each step hands out `{request_id: num_tokens}`: prefill, chunked prefill and
decode are one case (a request needs `num_tokens - num_computed_tokens` more
tokens computed). Running requests go first, oldest first; when the KV pool is
short, the newest running request is preempted (its blocks freed, its tokens
recomputed later). Waiting requests are admitted only in steps without
preemption, in arrival order.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from elasticmoe.engine.block_manager import BlockManager
from elasticmoe.engine.request import Request, RequestStatus


@dataclass
class SchedulerOutput:
    scheduled: list[tuple[Request, int]] = field(default_factory=list)  # (request, num tokens), decodes first
    preempted_ids: list[str] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled

    @property
    def num_tokens(self) -> int:
        return sum(n for _, n in self.scheduled)


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_batched_tokens: int, max_num_seqs: int) -> None:
        self.block_manager = block_manager
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0  # total, for metrics and tests
        self.skip_window = 64  # waiting requests looked past per step while their adapter swaps in

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        num_scheduled: dict[Request, int] = {}

        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            n = min(request.num_tokens - request.num_computed_tokens, budget)
            while not self.block_manager.allocate_slots(request, n):
                victim = self.running.pop()
                self._preempt(victim)
                out.preempted_ids.append(victim.request_id)
                if victim is request:
                    break
            else:
                num_scheduled[request] = n
                budget -= n
                i += 1

        # NOTE: a request whose adapter is still being swapped in is passed over, not waited on,
        # so requests for resident adapters behind it start (CoServe §4.2); at most
        # `skip_window` of them are looked past per step, and they keep their place in line.
        skipped: list[Request] = []
        while not out.preempted_ids and self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            request = self.waiting[0]
            if not request.is_ready:
                skipped.append(self.waiting.popleft())
                if len(skipped) >= self.skip_window:
                    break
                continue
            n = min(request.num_tokens - request.num_computed_tokens, budget)
            if not self.block_manager.allocate_slots(request, n):
                break
            self.waiting.popleft()
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            num_scheduled[request] = n
            budget -= n

        self.waiting.extendleft(reversed(skipped))
        # Decodes (one token) first: the model runner batches them into one attention call.
        out.scheduled = sorted(num_scheduled.items(), key=lambda item: item[1] != 1)
        return out

    def _preempt(self, request: Request) -> None:
        self.block_manager.free(request)
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        request.status = RequestStatus.WAITING
        self.waiting.appendleft(request)

    def finish(self, request: Request) -> None:
        """Remove a request from the queues and free its blocks (no-op for its absence)."""
        if request.status == RequestStatus.RUNNING:
            self.running.remove(request)
        elif request.status == RequestStatus.WAITING:
            self.waiting.remove(request)
        self.block_manager.free(request)
        request.status = RequestStatus.FINISHED
