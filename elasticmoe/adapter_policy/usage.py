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
    fallback usage source, and what the engine used alone before CoServe's policies)."""

    def __init__(self, decay: float = 0.9) -> None:
        if not 0.0 <= decay < 1.0:
            raise ValueError(f"decay: must be in [0, 1), got {decay}")
        self.decay = decay
        self.rate: dict[str, float] = {}

    def update(self, counts: Mapping[str, int], names: Iterable[str]) -> None:
        """One pass: `counts` requests arrived per name; `names` are the ones tracked (others drop)."""
        d = self.decay
        self.rate = {n: d * self.rate.get(n, 0.0) + (1 - d) * counts.get(n, 0) for n in names}
