"""The CoServe benchmark's pure parts: configurations, adapter popularity, the seeded workload,
the adapter cache, summary statistics and the server's counters (`coordinator.bench.coserve`).

Nothing here starts a server; everything is deterministic for a seed and unit-tested.
"""

from __future__ import annotations

import dataclasses
import random
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from coordinator.bench.report_output import progress_printer
from elasticmoe.bench.workload import power_law_shares

# name -> (eviction, arranging, assigning): CoServe (ASPLOS '25) Fig. 13's systems on our server.
CONFIGS: dict[str, tuple[str, str, str]] = {
    "coserve": ("coserve", "coserve", "coserve"),
    "lru_fcfs": ("lru", "fcfs", "coserve"),  # Samba-CoE: LRU eviction + first come, first served
    "fifo": ("fifo", "coserve", "coserve"),
    "parallel": ("coserve", "coserve", "parallel"),  # adapter-unaware least-loaded assignment
}
# The same arrivals and adapters with a slot for every adapter they use (registered alone, so all
# resident from the start): no swap, the adapters' compute unchanged. What the hot requests' TTFT
# would be if others' swaps cost them nothing.
RESIDENT = "resident"
REFERENCE = "reference"  # the same arrivals, every request on the base model: no adapter, no swap
ALL_CONFIGS = (*CONFIGS, RESIDENT, REFERENCE)


@dataclasses.dataclass(frozen=True, slots=True)
class Adapter:
    name: str
    kind: str  # "lora" | "esft"
    path: str
    share: float  # its request probability (declared as `usage_probability`)


@dataclasses.dataclass(frozen=True, slots=True)
class Arrival:
    arrival_s: float
    model: str | None  # an adapter's name; None: the base model
    prompt: list[int]
    max_tokens: int


def used_adapters(adapters: Sequence[Adapter], arrivals: Sequence[Arrival]) -> list[Adapter]:
    """The adapters `arrivals` ask for, in registration order."""
    asked = {a.model for a in arrivals}
    return [a for a in adapters if a.name in asked]


def popularity(names: Sequence[str], alpha: float, seed: int) -> dict[str, float]:
    """Each name's request share: the power law of S-LoRA / the ESFT bench over a seeded
    permutation of `names` (so LoRA and ESFT adapters mix along the popularity ranking)."""
    order = list(names)
    random.Random(seed).shuffle(order)
    return dict(zip(order, power_law_shares(len(order), alpha), strict=True))


def make_arrivals(shares: Mapping[str, float], base_share: float, rps: float, duration_s: float,
                  prompt_len: int, max_tokens: int, vocab_size: int, seed: int) -> list[Arrival]:
    """Poisson arrivals of rate `rps` over `duration_s`; each request is for the base model with
    probability `base_share`, else for an adapter drawn by `shares`. Times, prompts and choices
    come from separate seeded streams, so two configurations see the same requests."""
    if not rps > 0 or not duration_s > 0 or not 0 <= base_share <= 1:
        raise ValueError(f"workload: need rps > 0, duration_s > 0, 0 <= base_share <= 1; got {rps}, "
                         f"{duration_s}, {base_share}")
    timing, prompts, choice = random.Random(seed), random.Random(seed + 1), random.Random(seed + 2)
    names, weights = list(shares), list(shares.values())
    out, t = [], timing.expovariate(rps)
    while t < duration_s:
        is_base = not names or choice.random() < base_share
        model = None if is_base else choice.choices(names, weights=weights)[0]
        out.append(Arrival(t, model, [prompts.randrange(5, vocab_size) for _ in range(prompt_len)], max_tokens))
        t += timing.expovariate(rps)
    return out


def percentile(values: Sequence[float], q: float) -> float | None:
    """The q-th percentile (0-100, linear interpolation); None without values."""
    if not values:
        return None
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def latency_summary(values: Sequence[float | None]) -> dict[str, float | None]:
    """p50, p99 and mean in seconds of the values present."""
    present = [v for v in values if v is not None]
    return {"p50": percentile(present, 50), "p99": percentile(present, 99),
            "mean": statistics.fmean(present) if present else None}


def parse_metrics(text: str) -> dict[str, float]:
    """Unlabelled samples of a Prometheus text exposition: name -> value."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line and not line.startswith("#") and "{" not in line:
            name, _, value = line.partition(" ")
            try:
                out[name] = float(value)
            except ValueError:
                continue
    return out


def server_counters(metrics: Mapping[str, float], status: Mapping[str, Any]) -> dict[str, float]:
    """Switches, hits and the Fig. 15 timers from `/metrics` and `/admin/status`.

    LoRA counters are summed over the ranks. Where the status says the ranks swap in lockstep
    (`adapter_swaps.lora_swaps`: slots on the experts under expert parallelism), every rank of the
    active instance copies its share of the same adapter, so one switch counts dp times (divided
    out here, as the copy time, which the ranks spend side by side); ranks that swap their own
    slots each count their own switches."""
    swaps, requests = status["adapter_swaps"], status["requests"]
    m = metrics.get
    n = status["active_config"]["dp"] if swaps.get("lora_swaps") == "lockstep" else 1
    return {
        "lora_swaps_in": m("elasticmoe_lora_swaps_in_total", 0.0) / n,
        "lora_preloads": m("elasticmoe_lora_preloads_total", 0.0) / n,  # swaps-in no request waited for
        "lora_hits": m("elasticmoe_lora_hits_total", 0.0),
        "lora_misses": m("elasticmoe_lora_misses_total", 0.0),
        "lora_swap_s": m("elasticmoe_lora_swap_seconds_total", 0.0) / n,
        "esft_swaps_in": float(swaps["esft_swaps_in"]),
        "esft_swap_s": float(swaps.get("esft_swap_s", 0.0)),
        "esft_swap_waits": float(requests.get("swap_waits", 0)),
        "arranging_s": m("elasticmoe_request_arranging_seconds_total", 0.0),
        "assigning_s": float(requests.get("assigning_s", 0.0)),
    }


def counter_delta(after: Mapping[str, float], before: Mapping[str, float]) -> dict[str, float]:
    return {k: v - before.get(k, 0.0) for k, v in after.items()}


def hit_rate(counters: Mapping[str, float], num_esft_requests: int) -> tuple[float | None, float, float]:
    """(hit rate, hits, misses) over adapter requests: a LoRA request is a hit when the rank
    admitted it with its adapter in a slot (server counter), an ESFT request when it did not wait
    for a swap-in at the ingress (server counter of waits over the ESFT requests sent)."""
    esft_misses = min(counters["esft_swap_waits"], float(num_esft_requests))
    hits = counters["lora_hits"] + num_esft_requests - esft_misses
    misses = counters["lora_misses"] + esft_misses
    return (hits / (hits + misses) if hits + misses else None), hits, misses


# ---- the adapter cache ---------------------------------------------------------------------


def build_adapters(model_dir: str, cache_dir: Path, num_lora: int, num_esft: int, lora_rank: int,
                   esft_experts: int, progress: Callable[[str], None]) -> tuple[list[tuple[str, str, str]], float]:
    """[(name, kind, path)] of `num_lora` LoRA adapters (random rank-`lora_rank` on q_proj and
    v_proj) and `num_esft` ESFT adapters (`esft_experts` random experts per layer), written once
    under `cache_dir` and reused (an adapter whose files exist is not rewritten); and the seconds
    spent writing."""
    from elasticmoe.tools.make_esft_adapter import make_esft_adapter
    from elasticmoe.tools.make_lora_adapter import make_lora_adapter

    start, made = time.monotonic(), 0
    out: list[tuple[str, str, str]] = []
    for i in range(num_lora):
        path = cache_dir / f"lora-r{lora_rank}" / f"lora{i:04d}"
        if not (path / "adapter_model.safetensors").is_file():
            make_lora_adapter(model_dir, path, rank=lora_rank, seed=10_000 + i, target_modules=("q_proj", "v_proj"))
            made += 1
            if made % 100 == 0:
                progress(f"wrote {made} LoRA adapters ({time.monotonic() - start:.0f} s)")
        out.append((f"lora{i:04d}", "lora", str(path)))
    for i in range(num_esft):
        path = cache_dir / f"esft-e{esft_experts}" / f"esft{i:03d}"
        if not (path / "adapter_model.safetensors").is_file():
            make_esft_adapter(model_dir, path, experts_per_layer=esft_experts, seed=20_000 + i, noise=0.5)
            made += 1
            if made % 25 == 0:
                progress(f"wrote {made} adapters ({time.monotonic() - start:.0f} s)")
        out.append((f"esft{i:03d}", "esft", str(path)))
    return out, time.monotonic() - start


progress = progress_printer("coserve")
