"""Usage probabilities: how likely the next request needs each node (CoServe §4.3, §4.5).

CoServe evicts by *pre-assessed* usage probabilities instead of past usage (LRU): an offline
profile that ran the routing on a sample, or probabilities computed from known routing rules.
Here the sources, best first:

1. the offline profile (`Profile.usage_probability`, `elasticmoe.bench.adapter_profile`);
2. declared at registration (`usage_probability` of `POST /admin/adapters`, `load_lora(...,
   usage_probability=p)`);
3. only for nodes neither gives: the observed request rate, as a fallback. The probability mass
   the first two leave (1 - their sum, at least 0) is shared among these nodes in proportion to
   their observed rates (evenly while none was observed), so a guess never outranks what was
   pre-assessed by more than the mass that is unaccounted for.

Dependencies compose (`needed_probability`): a request that uses a router (or a per-token table)
needs every adapter the router mixes resident, so an adapter is needed with its own probability
plus that of each node it is reachable from (the events are disjoint: a request names one model).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from elasticmoe.adapter_policy.graph import DependencyGraph


def check_probability(value: float, what: str = "usage_probability") -> float:
    """`value` as a float in [0, 1], else `ValueError` naming `what`."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0.0 <= float(value) <= 1.0:
        raise ValueError(f"{what}: must be a number in [0, 1], got {value!r}")
    return float(value)


def usage_probabilities(
    names: Iterable[str],
    profiled: Mapping[str, float] | None = None,
    declared: Mapping[str, float] | None = None,
    observed: Mapping[str, float] | None = None,
) -> dict[str, float]:
    """Each of `names`' usage probability from the profile, else the declaration, else its share of
    the unaccounted mass by `observed` rate (see the module docstring). Every value is in [0, 1]."""
    profiled, declared, observed = profiled or {}, declared or {}, observed or {}
    out: dict[str, float] = {}
    unknown: list[str] = []
    for name in names:
        if name in profiled:
            out[name] = check_probability(profiled[name], f"profile usage_probability of {name!r}")
        elif name in declared:
            out[name] = check_probability(declared[name], f"usage_probability of {name!r}")
        else:
            unknown.append(name)
    if unknown:
        rest = max(0.0, 1.0 - sum(out.values()))
        rates = {n: max(0.0, float(observed.get(n, 0.0))) for n in unknown}
        total = sum(rates.values())
        for n in unknown:
            out[n] = rest * (rates[n] / total if total > 0 else 1.0 / len(unknown))
    return out


def needed_probability(graph: DependencyGraph, probabilities: Mapping[str, float]) -> dict[str, float]:
    """Per node: the probability that the next request needs it resident, its own usage
    probability plus that of every node it is reachable from (a request for a router needs all
    of its adapters, a request for an ESFT adapter the base experts it reaches), capped at 1.

    Each ancestor counts once, so diamonds and cycles add nothing twice.
    """
    out: dict[str, float] = {}
    for name in graph.nodes:
        seen, stack = {name}, list(graph.predecessors(name))
        while stack:
            p = stack.pop()
            if p not in seen:
                seen.add(p)
                stack.extend(graph.predecessors(p))
        out[name] = min(1.0, sum(probabilities.get(n, 0.0) for n in seen))
    return out


class RateEstimator:
    """Observed request rate per name: an exponential moving average of requests per pass (the
    fallback usage source, and what the engine used alone before CoServe's policies).

    Kept lazily: each name's rate as of the pass it last changed, decayed when read. A pass then
    costs the names that had arrivals, not every name tracked (the engine runs one per step, with
    up to thousands of adapters registered); the values equal the eager average's up to float
    rounding."""

    def __init__(self, decay: float = 0.9) -> None:
        if not 0.0 <= decay < 1.0:
            raise ValueError(f"decay: must be in [0, 1), got {decay}")
        self.decay = decay
        self._passes = 0
        self._kept: dict[str, tuple[float, int]] = {}  # name -> (its rate, the pass that set it)

    def update(self, counts: Mapping[str, int]) -> None:
        """One pass: `counts` requests arrived per name; every other name's rate decays."""
        self._passes += 1
        d = self.decay
        for name, count in counts.items():
            self._kept[name] = (d * self._rate(name, self._passes - 1) + (1 - d) * count, self._passes)

    def forget(self, name: str) -> None:
        """`name` is no longer tracked (unloaded): a later one of the same name starts at 0."""
        self._kept.pop(name, None)

    def rates(self, names: Iterable[str]) -> dict[str, float]:
        """Each of `names`' rate after the last pass (0 for a name without arrivals)."""
        return {name: self._rate(name, self._passes) for name in names}

    def _rate(self, name: str, after_pass: int) -> float:
        """`name`'s rate after pass `after_pass` (the one that set it, or a later one)."""
        rate, at = self._kept.get(name, (0.0, after_pass))
        return rate * self.decay ** (after_pass - at)
