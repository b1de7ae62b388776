"""`ActiveInstance`: what serves right now, as one immutable value.

The cluster is its only author (`ClusterManager.publish`): it builds a new snapshot when an
instance is activated (start, scale, repair) or when the adapters that accept requests
change, and publishes it (with the gate and health) as one `RoutingState` for the ingress
(`coordinator.routing_state`). The coordinator's own readers (scaler, healer, adapters,
status) read `ClusterManager.active`. Nobody writes another object's fields, and no reader
can see the ranks of one instance with the limits of another.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class ActiveInstance:
    """The serving instance, its ranks (the router's targets, DP rank order), the devices they run
    on, its context limit (the smallest over its ranks) and the adapters accepting requests."""

    instance: Any  # imm.instance.Instance (Any: its tests need no Ray)
    ranks: tuple[Any, ...]
    device_ids: tuple[int, ...]
    max_model_len: int
    adapters: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not self.ranks:
            raise ValueError("active instance: needs at least one rank")
        if self.max_model_len < 1:
            raise ValueError(f"active instance: max_model_len must be >= 1, got {self.max_model_len}")

    def with_adapters(self, names: tuple[str, ...]) -> ActiveInstance:
        return dataclasses.replace(self, adapters=tuple(names))
