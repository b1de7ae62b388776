"""Driving the ranks of an expert-parallel group in lockstep."""

from __future__ import annotations

import torch
import torch.distributed as dist


def any_rank_has_work(has_work: bool, group: dist.ProcessGroup | None = None) -> bool:
    """True if any rank of the group still has requests. Every rank must call it each round."""
    flag = torch.tensor([int(has_work)])
    dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
    return bool(flag.item())


def run_until_all_done(engine, group: dist.ProcessGroup | None = None) -> list:
    """Step `engine` until every rank of the group is out of work; returns this rank's outputs.

    A rank without requests still steps (an empty forward) so the MoE
    collectives of the busy ranks find their partners.
    """
    outputs = []
    while any_rank_has_work(engine.has_unfinished_requests(), group):
        outputs.extend(engine.step())
    return outputs
