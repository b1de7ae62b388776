"""Continuous batching under a token budget, with chunked prefill and preemption.

Each step hands out `{request_id: num_tokens}`: prefill, chunked prefill and
decode are one case (a request needs `num_tokens - num_computed_tokens` more
tokens computed). Running requests go first, oldest first; when the KV pool is
short, the newest running request is preempted (its blocks freed, its tokens
recomputed later). Waiting requests are admitted only in steps without
preemption, in arrival order, except that the first `window` of them are taken
grouped by LoRA adapter (CoServe §4.2, see `Scheduler._admission_order`). A request
admitted starts past the blocks of its prefix the KV cache still holds
(`BlockManager.match_prefix`), a preempted one too.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Hashable, Iterator
from dataclasses import dataclass, field
from itertools import islice

from elasticmoe.adapter_policy.arranging import arranger
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


def adapter_key(request: Request) -> Hashable:
    """What admission groups a request by: its LoRA adapter (the set of them when routed per
    token); None for the base model and ESFT adapters, so without LoRA every request is in one
    group and admission is plain arrival order."""
    binding = request.binding
    if binding.routing is not None:
        return frozenset(binding.routing.names)
    return binding.name if not binding.is_esft else None


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_batched_tokens: int, max_num_seqs: int,
                 window: int = 16, arranging: str = "coserve") -> None:
        if window < 1:
            raise ValueError(f"scheduling_window: must be >= 1, got {window}")
        self.block_manager = block_manager
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.window = window  # waiting requests at the head admitted in the arranging policy's order
        self.arrange = arranger(arranging)
        self.arrange_s = 0.0  # time spent arranging the window (CoServe Fig. 15)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0  # total, for metrics and tests

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        num_scheduled: dict[Request, int] = {}
        self.block_manager.begin_step()

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
                if n > 1:  # a prefill chunk: what it computes, others of its prefix take next step
                    self.block_manager.computing(request, n)

        if not out.preempted_ids:
            budget = self._admit(num_scheduled, budget)
        # Decodes (one token) first: the model runner batches them into one attention call.
        out.scheduled = sorted(num_scheduled.items(), key=lambda item: item[1] != 1)
        return out

    def window_requests(self) -> list[Request]:
        """The waiting requests admission groups by adapter (the first `window`), in queue order;
        the adapters worth swapping in now are those of the not-ready ones."""
        return list(islice(self.waiting, self.window))

    def _admission_order(self, window: list[Request]) -> list[Request]:
        """The `window` in the arranging policy's order: by default grouped by `adapter_key`,
        groups in the order of their oldest request, arrival order inside a group (CoServe §4.2
        arranges a request behind the queued requests of its expert, so each one is loaded once
        and its requests run together); `fcfs`: as it came.

        No request starves: readiness is the same for a whole group (it is its adapter's
        residency), so the first request admitted in a step is always the oldest ready one in
        the queue. Only requests inside the window (at most `window - 1` younger ones per step)
        can pass a request, never those behind the window, and a request never moves back in
        the queue: one with p ready requests ahead of it is admitted within p + 1 steps that
        admit anyone (preempted requests rejoin at the front, as in plain arrival order).
        """
        start = time.perf_counter()
        order = self.arrange(window, adapter_key)
        self.arrange_s += time.perf_counter() - start
        return order

    def _admit(self, num_scheduled: dict[Request, int], budget: int) -> int:
        """Start waiting requests while the budget, `max_num_seqs` and the KV pool allow: the
        window in admission order, then the rest in arrival order. Returns the budget left.

        NOTE: a request whose adapter is still being swapped in is passed over, not waited on,
        so requests for resident adapters behind it start (CoServe §4.2), however many wait for
        swaps ahead of them; every request passed over keeps its place in line. Looking past
        them all costs ~0.7 us each (admission control, `--max-queued`, bounds the queue). A
        bound of 64 left the requests of resident adapters behind a queue of swap waiters: on
        the elastic server under a saturating many-adapter load (CoServe bench, 16 req/s) their
        TTFT p50 was 4.2 s, 0.6-0.7 s without it, and throughput went from 109 to 129-132 tok/s.
        """
        if not self.waiting or budget <= 0 or len(self.running) >= self.max_num_seqs:
            return budget
        taken = [self.waiting.popleft() for _ in range(min(self.window, len(self.waiting)))]
        for request in self._candidates(taken):
            if budget <= 0 or len(self.running) >= self.max_num_seqs:
                break
            if not request.is_ready:
                continue
            self.block_manager.match_prefix(request)  # its cached first blocks: not computed again
            if 2 * self.block_manager.num_in_flight_tokens(request) >= request.num_tokens - request.num_computed_tokens:
                # Most of what it would compute is being computed now for a request of the same prefix (`n`
                # choices, a burst of one system prompt): it starts next step, past those blocks too.
                self.block_manager.free(request)
                continue
            n = min(request.num_tokens - request.num_computed_tokens, budget)
            if not self.block_manager.allocate_slots(request, n):
                self.block_manager.free(request)  # the matched blocks go back to the cache
                break  # the pool is full: nobody after this request starts either
            self.block_manager.count_lookup(request)
            if request.num_cached_tokens is None:
                request.num_cached_tokens = min(request.num_computed_tokens, request.num_prompt_tokens)
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            num_scheduled[request] = n
            budget -= n
            self.block_manager.computing(request, n)
        # `taken` is in queue order: the requests not started go back to the front as they were.
        self.waiting.extendleft(reversed([r for r in taken if r.status is RequestStatus.WAITING]))
        return budget

    def _candidates(self, taken: list[Request]) -> Iterator[Request]:
        """The window (`taken`, already off the queue) in admission order, then the requests behind
        it in arrival order, each moved from the queue to `taken` as it is offered."""
        yield from self._admission_order(taken)
        while self.waiting:
            taken.append(self.waiting.popleft())
            yield taken[-1]

    def _preempt(self, request: Request) -> None:
        self.block_manager.free(request)
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
