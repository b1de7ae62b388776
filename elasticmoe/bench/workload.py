"""Seeded request workloads of the adapter benchmarks: power-law adapter shares (the
distribution S-LoRA and ExpertWeave use: adapter i gets ((i+1)/N)^alpha - (i/N)^alpha of
the requests; alpha = 1 is uniform) and Poisson arrivals."""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass


def power_law_shares(num_adapters: int, alpha: float) -> list[float]:
    """Request share of each adapter: `((i + 1) / N)^alpha - (i / N)^alpha` (see the module doc)."""
    if num_adapters < 1 or not alpha > 0:
        raise ValueError(f"power law: need num_adapters >= 1 and alpha > 0, got {num_adapters}, {alpha}")
    return [((i + 1) / num_adapters) ** alpha - (i / num_adapters) ** alpha for i in range(num_adapters)]


@dataclass(frozen=True, slots=True)
class TimedRequest:
    arrival_s: float  # since the run's start
    prompt_token_ids: list[int]
    adapter_index: int  # into the adapter names of the run


def make_workload(
    num_requests: int, rps: float, shares: Sequence[float], input_len: int, vocab_size: int, seed: int
) -> list[TimedRequest]:
    """Poisson arrivals of rate `rps`, each on adapter `i` with probability `shares[i]`.

    Arrival times and prompts depend on `seed` only, not on `shares`, so every run of a
    repeat sees the same prompts at the same times; the adapter choices come from their
    own stream."""
    if num_requests < 1 or not rps > 0:
        raise ValueError(f"workload: need num_requests >= 1 and rps > 0, got {num_requests}, {rps}")
    timing, prompts, choice = random.Random(seed), random.Random(seed + 1), random.Random(seed + 2)
    out, t = [], 0.0
    indices = list(range(len(shares)))
    for _ in range(num_requests):
        # Ids 0..2 are pad/bos/eos in our checkpoints; stay clear of them.
        prompt = [prompts.randrange(3, vocab_size) for _ in range(input_len)]
        out.append(TimedRequest(t, prompt, choice.choices(indices, weights=shares)[0]))
        t += timing.expovariate(rps)
    return out
