"""Greedy runs of an `LLMEngine` that keep every step's logits: the oracle comparisons of the
expert-parallel and expert-offloading tests (one rank, or every rank of an EP group in lockstep);
and a read error injected into an expert cache's own copies."""

from __future__ import annotations

import torch

from elasticmoe.engine.expert_cache import ExpertCache
from elasticmoe.engine.llm_engine import LLMEngine
from elasticmoe.kernels.copy_engine import WHOLE
from elasticmoe.parallel.lockstep import run_until_all_done
from elasticmoe.sampling_params import SamplingParams


def greedy_run(engine: LLMEngine, prompts, max_tokens: int, group=None) -> tuple[dict[str, list[int]], list[torch.Tensor]]:
    """Output token ids per request id ("0", "1", ... in prompt order) and the logits of every
    step that sampled; `group`: step with the EP group until every rank is done."""
    logits: list[torch.Tensor] = []
    original = engine.model.compute_logits

    def record(hidden):
        out = original(hidden)
        logits.append(out.clone())
        return out

    engine.model.compute_logits = record  # type: ignore[method-assign]
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))
    if group is None:
        outs = []
        while engine.has_unfinished_requests():
            outs += engine.step()
    else:
        outs = run_until_all_done(engine, group)
    return {o.request_id: o.output_token_ids for o in outs if o.finished}, [t for t in logits if t.numel()]


def fail_forward_copies(cache: ExpertCache, failing, message: str = "disk read error") -> dict[str, bool]:
    """Make the copies the cache makes on the forward thread (`ExpertCopier.copy_now`: on-demand
    loads, their share of them) raise `OSError(message)` for experts where `failing(layer, local)`,
    while the returned switch's "on" is True. The copier's own thread copies outside this."""
    switch = {"on": True}
    original = cache.copier.copy_now

    def flaky(copy, part=WHOLE):
        if switch["on"] and failing(copy[0], copy[1]):
            raise OSError(message)
        return original(copy, part)

    cache.copier.copy_now = flaky  # type: ignore[method-assign]
    return switch
