"""The offloading policies by name (`--offload-policy`)."""

from __future__ import annotations

from collections.abc import Callable

from elasticmoe.offload.finemoe import FineMoEPolicy
from elasticmoe.offload.lfu import LFUPolicy
from elasticmoe.offload.lru import LRUPolicy, OnDemandPolicy
from elasticmoe.offload.policy import OffloadPolicy, PolicyConfig

POLICIES: dict[str, Callable[[PolicyConfig], OffloadPolicy]] = {
    "finemoe": FineMoEPolicy,
    "lru": LRUPolicy,
    "lfu": LFUPolicy,
    "on_demand": OnDemandPolicy,
}


def make_policy(name: str, config: PolicyConfig) -> OffloadPolicy:
    """A fresh policy (its own store and statistics) for the model shape in `config`."""
    try:
        factory = POLICIES[name]
    except KeyError:
        raise ValueError(f"offload policy: unknown {name!r}, choose one of {', '.join(POLICIES)}") from None
    return factory(config)
