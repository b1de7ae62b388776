"""Which search guides which layer (FineMoE §4.2): the hybrid switch at prefetch distance d.

The paper counts layers from 1: layers 1..d are guided by the semantic search (§4.2.1),
made before the iteration's first layer; layer l > d by the trajectory search (§4.2.2)
over the trajectory of layers 1..l-d, made as soon as layer l-d has been routed, i.e. d
layers ahead. Here layers count from 0: layer l < d is semantic; layer l >= d uses the
first `l - d + 1` layers and is searched right after layer `l - d` ran.
"""

from __future__ import annotations


def _check(layer: int, prefetch_distance: int) -> None:
    if layer < 0 or prefetch_distance < 1:
        raise ValueError(f"search schedule: need layer >= 0 and prefetch distance >= 1, "
                         f"got {layer}, {prefetch_distance}")


def uses_semantic_search(layer: int, prefetch_distance: int) -> bool:
    """True for the first d layers: no trajectory of this iteration exists early enough."""
    _check(layer, prefetch_distance)
    return layer < prefetch_distance


def trajectory_length(layer: int, prefetch_distance: int) -> int:
    """How many observed layers the trajectory search for `layer` compares (eq. 5's l - d)."""
    if uses_semantic_search(layer, prefetch_distance):
        raise ValueError(f"layer {layer} is guided by the semantic search (prefetch distance {prefetch_distance})")
    return layer - prefetch_distance + 1


def trajectory_target(observed_layer: int, prefetch_distance: int, num_layers: int) -> int | None:
    """The layer whose experts the trajectory search predicts once `observed_layer` has been
    routed, or None past the last layer."""
    _check(observed_layer, prefetch_distance)
    target = observed_layer + prefetch_distance
    return target if target < num_layers else None
