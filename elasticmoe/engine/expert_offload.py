"""Expert offloading in the engine: what the MoE blocks and the model runner call.

An engine step with offloading (FineMoE §4.5, `elasticmoe.offload.policy` has the full loop):

    begin_step(scheduled)        the policy begins an iteration; the prefetcher starts on its plan
    per MoE layer l:
        observe(l, x, topk_ids)  the router ran: the policy sees the gate's probabilities [T, E]
        run_experts(l, xs, ...)  the experts this rank holds and the tokens need are made resident
                                 (on demand, waves if they outnumber the cache), then one grouped
                                 GEMM over the cache's pool rows
    end_step(live request ids)   the policy ends the iteration (FineMoE stores its expert maps)

Outputs equal a fully resident run: the experts compute from identical weights, only the row
of the pool they sit in differs. Under expert parallelism each rank caches its own experts:
`run_experts` runs on the rank that owns them (after the all-to-all), `observe` sees the
rank's own tokens.

The policy's work runs on the forward thread by default: the iteration's begin (its search and
first plan) before layer 0, each layer's observation and plan once that layer's experts are
ensured (the order of the paper's loop in `policy`: the layer's own loads come first, then the
plan for the next layers, whose copies run beside its GEMM), the iteration's end after the last
layer. `EngineConfig.offload_policy_thread=True` runs the same jobs in the same order on a thread
beside the forward (`policy_worker`): the begin while the forward embeds and runs layer 0's
attention; each layer's job while the forward runs its GEMM and the next layer's attention (both
release the GIL). There the forward never waits for its plans: a lookup takes whatever
the cache holds when it comes, and the cache's lock keeps the two consistent (a lookup may wait
on it for a job in progress). The thread takes the policy's ~1 ms per output token off the
forward, but on the 2-vCPU hosts measured the forward pays about as much back: waking the thread
for every job costs it ~20-50 us, and the two share the GIL. With the copier polling
(`elasticmoe.kernels.copy_engine`), the forward's own submits became cheap and the inline
policy's TPOT 0.06-0.10x of resident lower than the thread's (docs/offload.md, "Wakes cost the
forward").

A policy that raises in any of its calls is logged and ignored for the rest of the iteration
(no prefetching then); loads on demand still run, so no request fails for a policy's fault.

A cache whose budget holds every expert of the rank runs no policy and queues no prefetch: it
never evicts, so there is nothing to plan or choose (each expert loads on its first use, or
when the cache is warmed). The policy's searches would cost the forward ~1.5 ms per output token
for nothing (FineMoE on the trained small model).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Collection, Sequence
from functools import partial

import numpy as np
import torch

from elasticmoe.engine.expert_cache import ExpertCache
from elasticmoe.engine.policy_worker import Job, PolicyWorker
from elasticmoe.engine.request import Request
from elasticmoe.layers.experts import grouped_experts_at_rows, grouped_experts_sorted
from elasticmoe.models.common import ExpertsHook
from elasticmoe.offload.policy import RequestContext

logger = logging.getLogger(__name__)


class ExpertOffload:
    """The hooks of one engine's MoE blocks into its expert cache."""

    def __init__(self, cache: ExpertCache, routers: Sequence[torch.Tensor], local_expert_ids: Sequence[int],
                 semantic: str = "iteration", policy_thread: bool = False) -> None:
        """`semantic`: one of `SEMANTIC_SOURCES` (`EngineConfig.offload_semantic`, checked there);
        `policy_thread`: the policy's jobs run on a thread beside the forward (see the module
        docstring), else on the forward thread."""
        self.cache = cache
        self.policy = cache.policy
        self.routers = [r.float() for r in routers]  # [E, H] per MoE layer: the next layer's gate on this input (lru)
        self._global_ids = [int(e) for e in local_expert_ids]  # local index -> global id
        self._semantic = semantic
        # request -> its prompt's mean embedding ("prompt"), or None ("iteration": computed per step);
        # the keys are the requests begun and not yet ended
        self._embeddings: dict[str, torch.Tensor | None] = {}
        self._observing = False  # an iteration is open: its layers go to the policy (the forward's flag)
        self._policy_ok = False  # the policy has not failed this iteration (the jobs' flag)
        self._policy_runs = not cache.holds_every_expert  # see the module docstring
        self.policy_s = 0.0  # time in the policy's calls (searches, plans), on whichever thread: FineMoE Fig. 17
        # Where the policy's jobs run: a thread beside the forward, or (None) the forward itself.
        self._worker = PolicyWorker() if policy_thread and self._policy_runs else None
        self._deferred: Job | None = None  # a layer's job, held until that layer's experts are ensured

    # ---- the iteration ----------------------------------------------------------------

    def begin_step(self, scheduled: Sequence[tuple[Request, int]], embed: torch.Tensor) -> None:
        """The step runs `scheduled` (request, tokens this step) in token order; `embed` is the
        model's input-embedding table, whose rows give a request's semantic embedding (FineMoE
        §4.2.1: the embedding layer's output, mean-pooled over the tokens this step feeds for the
        request, or over its prompt: `RequestContext`)."""
        if not self._policy_runs:
            return
        # The contexts are made here: the requests change once the step is over.
        contexts = [RequestContext(request.request_id, n, self._embedding(request, n, embed),
                                   is_prefill=request.num_computed_tokens < request.num_prompt_tokens)
                    for request, n in scheduled]
        self._observing = bool(contexts)  # an empty step (an idle EP rank) is not an iteration
        if self._observing:
            self._submit(lambda: self._begin_iteration(contexts))

    def observe(self, layer: int, x: torch.Tensor, probs: torch.Tensor, topk_ids: torch.Tensor) -> None:
        """MoE layer `layer` routed `x` [T, H] with the gate's probabilities `probs` [T, E] (the
        route's own) to `topk_ids` [T, k]."""
        if not self._observing or not self.policy.observes_layers:
            return
        next_probs = None
        if self.policy.needs_next_layer_gate and layer + 1 < len(self.routers):
            next_probs = torch.softmax(x.float() @ self.routers[layer + 1].T, dim=-1)
        # Held until this layer's `ensure` (`run_experts`) has taken what it needs: the job's plan is
        # for later layers. Inline, planned first, its copies would be cancelled and queued again by
        # every `ensure` that loads (and their victims chosen twice); on the worker, started now, it
        # would hold the cache's lock against that `ensure`. A rank that computes no row of the
        # layer (EP) releases it at the next router or step end.
        self._release_deferred()
        self._deferred = partial(self._observe_layer, layer, probs, topk_ids, next_probs)

    def end_step(self, live_request_ids: Collection[str]) -> None:
        """After the step: requests no longer live are forgotten (LFU keeps their matrices)."""
        if not self._policy_runs:
            return
        finished = [r for r in self._embeddings if r not in live_request_ids]
        for request_id in finished:
            del self._embeddings[request_id]
        self._release_deferred()
        self._submit(lambda: self._end_iteration(finished))
        self._observing = False

    def drain(self) -> None:
        """Run the policy's jobs so far, the last layer's held one too, and wait for them (the
        forward thread, between steps: tests, benchmarks)."""
        self._release_deferred()
        if self._worker is not None:
            self._worker.drain()

    # ---- the policy's jobs (on the worker, or inline) -------------------------------------

    def _submit(self, job: Job) -> None:
        if self._worker is None:
            job()
        else:
            self._worker.submit(job)

    def _release_deferred(self) -> None:
        if self._deferred is not None:
            job, self._deferred = self._deferred, None
            self._submit(job)

    def _begin_iteration(self, contexts: list[RequestContext]) -> None:
        self._policy_ok = True
        if self._call_policy(lambda: self.policy.begin_iteration(contexts)):
            self.cache.replan()

    def _observe_layer(self, layer: int, probs: torch.Tensor, topk_ids: torch.Tensor,
                       next_probs: torch.Tensor | None) -> None:
        if self._call_policy(lambda: self.policy.observe_layer(layer, probs, topk_ids, next_probs)):
            # After the layer's `ensure`, which protects what the layer computes with from the
            # plan's victims (under EP the experts this rank computes for every rank's tokens)
            self.cache.replan()

    def _end_iteration(self, finished: list[str]) -> None:
        self._policy_ok = True  # end every iteration that began, even one a policy error cut short
        self._call_policy(lambda: self.policy.end_iteration(finished))
        self._policy_ok = False

    def _embedding(self, request: Request, num_tokens: int, embed: torch.Tensor) -> torch.Tensor:
        if self._semantic == "iteration":
            self._embeddings[request.request_id] = None
            first = request.num_computed_tokens
            return _mean_embedding(embed, request.token_ids[first : first + num_tokens])
        emb = self._embeddings.get(request.request_id)
        if emb is None:
            emb = self._embeddings[request.request_id] = _mean_embedding(embed, request.prompt_token_ids)
        return emb

    def _call_policy(self, call) -> bool:
        """Run one policy call under the cache's lock; False (and no more of this iteration) if it
        raised or an earlier call of the iteration did."""
        if not self._policy_ok:
            return False
        started = time.perf_counter()
        try:
            with self.cache.locked():
                call()
            return True
        except Exception:  # noqa: BLE001 - see the module docstring
            logger.exception("offload policy %s failed; no prefetching until the next iteration", self.policy.name)
            self._policy_ok = False
            return False
        finally:
            self.policy_s += time.perf_counter() - started

    # ---- the experts --------------------------------------------------------------------

    def run_experts(self, layer: int, xs: torch.Tensor, sorted_local_slots: torch.Tensor,
                    lora: tuple[ExpertsHook, torch.Tensor] | None = None) -> torch.Tensor:
        """Rows `xs` [N, H] sorted by this rank's local expert index -> their experts' outputs
        [N, H] (unweighted), computed from the cache's pool rows. `lora` (hook, `lora_slots`
        [N, 2K]): the rows' LoRA adapters on the experts, whose factors stay resident (indexed by
        expert, not by pool row): the hook computes both from the rows the cache holds."""
        if xs.shape[0] == 0:
            return xs.new_empty(xs.shape)
        bounds, local_ids = _groups(sorted_local_slots)
        experts = [self._global_ids[i] for i in local_ids]
        capacity = self.cache.capacity
        if len(experts) <= capacity:
            return self._wave(layer, xs, sorted_local_slots, bounds, local_ids, experts, lora)
        out = torch.empty_like(xs)
        for first in range(0, len(experts), capacity):  # waves: a cache smaller than the layer's need
            last = min(first + capacity, len(experts))
            start, end = bounds[first], bounds[last]
            out[start:end] = self._wave(layer, xs[start:end], sorted_local_slots[start:end],
                                        [b - start for b in bounds[first : last + 1]], local_ids[first:last],
                                        experts[first:last], None if lora is None else (lora[0], lora[1][start:end]))
        return out

    def _wave(self, layer: int, xs: torch.Tensor, sorted_local_slots: torch.Tensor, offsets: list[int],
              local_ids: list[int], experts: list[int], lora: tuple[ExpertsHook, torch.Tensor] | None
              ) -> torch.Tensor:
        """Groups of `xs` (`offsets` [G + 1]: local experts `local_ids`, global `experts`), at most
        the cache's capacity of them, made resident and computed from their pool rows."""
        rows = self.cache.ensure(layer, experts)
        self._release_deferred()  # the policy's job of this layer runs beside the GEMM below
        if lora is None:
            return self._compute(xs, offsets, rows)
        slot_rows = torch.zeros(len(self._global_ids), dtype=torch.long)  # the others have no rows here
        slot_rows[torch.tensor(local_ids, dtype=torch.long)] = torch.tensor(rows, dtype=torch.long)
        hook, lora_slots = lora
        return hook.experts(xs, sorted_local_slots, lora_slots, self.cache.w13, self.cache.w2, slot_rows)

    def _compute(self, xs: torch.Tensor, offsets: list[int], rows: list[int]) -> torch.Tensor:
        """Groups of `xs` (`offsets` [G + 1]) through pool rows `rows` [G] (ensured resident)."""
        offsets_t, rows_t = torch.tensor(offsets, dtype=torch.long), torch.tensor(rows, dtype=torch.long)
        ys = grouped_experts_at_rows(xs, offsets_t, rows_t, self.cache.w13, self.cache.w2)
        if ys is not None:
            return ys
        # PyTorch paths: rows grouped by ascending pool row, then back
        row_slots = rows_t.repeat_interleave(offsets_t.diff())
        order = torch.argsort(row_slots, stable=True)
        ys = grouped_experts_sorted(xs.index_select(0, order), row_slots.index_select(0, order),
                                    self.cache.w13, self.cache.w2)
        return torch.empty_like(xs).index_copy_(0, order, ys)

    def close(self) -> None:
        """Stop the policy's thread (after its jobs) and the cache's copier (after the copy in
        progress, if any)."""
        self._deferred = None
        if self._worker is not None:
            self._worker.close()
        self.cache.close()

    def stats(self) -> dict[str, float | int | str]:
        """The cache's counters once the policy's jobs submitted so far have run (any thread)."""
        if self._worker is not None:
            self._worker.drain()
        return {**self.cache.stats(), "policy_s": round(self.policy_s, 6)}


# Sorted rows up to this many are grouped in Python: a decode step's few values, where each NumPy
# call's dispatch costs more than the loop (this runs per MoE layer of every step).
_GROUP_IN_PYTHON = 64


def _groups(sorted_slots: torch.Tensor) -> tuple[list[int], list[int]]:
    """Rows sorted by slot (at least one) -> (`bounds` [G + 1]: group g is rows bounds[g]:bounds[g
    + 1]; the slot of each group [G])."""
    if sorted_slots.shape[0] <= _GROUP_IN_PYTHON:
        slots = sorted_slots.tolist()
        bounds, ids = [0], [slots[0]]
        for i in range(1, len(slots)):
            if slots[i] != slots[i - 1]:
                bounds.append(i)
                ids.append(slots[i])
        bounds.append(len(slots))
        return bounds, ids
    slots_np = sorted_slots.numpy()
    starts = np.flatnonzero(np.diff(slots_np)) + 1
    return [0, *starts.tolist(), len(slots_np)], slots_np[np.concatenate(([0], starts))].tolist()


def _mean_embedding(embed: torch.Tensor, token_ids: Sequence[int]) -> torch.Tensor:
    """The mean of `embed`'s rows for `token_ids`, in float32: [h]. One token (a decode step):
    its row, the same values in one op instead of three (a view of a float32 table: callers
    only read it)."""
    if len(token_ids) == 1:
        return embed[token_ids[0]].float()
    return embed.index_select(0, torch.tensor(token_ids, dtype=torch.long)).float().mean(dim=0)
