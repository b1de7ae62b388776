"""Choose the balanced expert placement that moves the fewest experts.

Given where experts are now and the target devices (in rank order), every
balanced placement gives `E % R` ranks `E // R + 1` experts and the rest
`E // R`. A device can keep at most min(capacity, experts it holds); handing the
larger capacities to the devices that hold more maximises the experts kept
(min(a, b) is supermodular, so the sorted matching is optimal), and every other
expert must move. Kept experts keep their slots (a device keeps its lowest
slots), so this placement needs no Remap; arrivals fill the slots after them.

With the experts' expected load known (tokens routed to each), `balance_expert_load` then
swaps experts between ranks until no rank carries much more than the mean: equal counts, so
equal memory, and roughly equal work per rank.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from elasticmoe.parallel.expert_placement import ExpertPlacement


def max_overlap_placement(
    held: Mapping[int, Sequence[int]],
    target_device_ids: Sequence[int],
    num_experts: int,
    node_of: Mapping[int, int] | None = None,
) -> ExpertPlacement:
    """Balanced placement over `target_device_ids` (rank order) with the most experts kept.

    `held` maps each current device to its experts in slot order (devices not in
    the target give up all of theirs). A moved expert goes to a device with room
    on its source's node if there is one (`node_of`: device -> node), else to the
    device with the most room left, lowest rank first, which spreads arrivals.
    """
    num_ranks = len(target_device_ids)
    if not 1 <= num_ranks <= num_experts:
        raise ValueError(f"ep_size: must be in [1, num_experts={num_experts}], got {num_ranks}")
    if sorted(e for experts in held.values() for e in experts) != list(range(num_experts)):
        raise ValueError("placement: the current devices must hold each expert exactly once")
    node_of = node_of or {}
    base, extra = divmod(num_experts, num_ranks)
    by_count = sorted(range(num_ranks), key=lambda r: (-len(held.get(target_device_ids[r], ())), r))
    capacity = {r: base + (i < extra) for i, r in enumerate(by_count)}

    local: list[list[int]] = [list(held.get(d, ()))[: capacity[r]] for r, d in enumerate(target_device_ids)]
    kept = {e for experts in local for e in experts}
    surplus = [(d, e) for d, experts in held.items() for e in experts if e not in kept]
    for src, e in surplus:
        room = [r for r in range(num_ranks) if len(local[r]) < capacity[r]]
        src_node = node_of.get(src)
        r = min(
            room,
            key=lambda r: (node_of.get(target_device_ids[r]) != src_node, len(local[r]) - capacity[r], r),
        )
        local[r].append(e)

    to_rank, to_slot = [0] * num_experts, [0] * num_experts
    for r, experts in enumerate(local):
        for slot, e in enumerate(experts):
            to_rank[e], to_slot[e] = r, slot
    return ExpertPlacement(num_experts, num_ranks, tuple(to_rank), tuple(to_slot))


def num_experts_kept(
    held: Mapping[int, Sequence[int]], target_device_ids: Sequence[int], num_experts: int
) -> int:
    """The most experts any balanced placement over the target devices keeps in place."""
    base, extra = divmod(num_experts, len(target_device_ids))
    counts = sorted((len(held.get(d, ())) for d in target_device_ids), reverse=True)
    return sum(min(n, base + (i < extra)) for i, n in enumerate(counts))


def rank_loads(placement: ExpertPlacement, load: Sequence[float]) -> list[float]:
    """Expected load of each rank: the sum of its experts' `load` (e.g. tokens routed to them)."""
    out = [0.0] * placement.num_ranks
    for e, r in enumerate(placement.expert_to_rank):
        out[r] += load[e]
    return out


def load_imbalance(placement: ExpertPlacement, load: Sequence[float]) -> float:
    """The busiest rank's expected load over the mean (1.0 = balanced; 1.0 without any load)."""
    loads = rank_loads(placement, load)
    mean = sum(loads) / len(loads)
    return max(loads) / mean if mean > 0 else 1.0


def balance_expert_load(placement: ExpertPlacement, load: Sequence[float], tolerance: float = 0.1) -> ExpertPlacement:
    """Swap experts between the busiest and the idlest rank while that lowers the busiest one's
    expected load, until it is within `tolerance` of the mean (ElasticMoE's load-imbalance point;
    EPLB without replicas). A swap exchanges two experts' ranks and slots, so every rank keeps
    its expert count (and memory), and it moves two experts: balance costs copies, so the scale's
    placement stops as soon as the tolerance is met (10% by default: counts from a short window are
    noisy, and chasing the noise would move experts for nothing). Each swap lowers the busiest
    rank's load or ends the search, so it terminates."""
    if len(load) != placement.num_experts:
        raise ValueError(f"load: one value per expert ({placement.num_experts}), got {len(load)}")
    if any(x < 0 for x in load):
        raise ValueError("load: values must be >= 0")
    to_rank, to_slot = list(placement.expert_to_rank), list(placement.expert_to_slot)
    loads = rank_loads(placement, load)
    mean = sum(loads) / len(loads)
    for _ in range(placement.num_experts):  # a bound; each swap strictly improves the busiest rank
        hi = max(range(len(loads)), key=lambda r: (loads[r], -r))
        lo = min(range(len(loads)), key=lambda r: (loads[r], r))
        if mean == 0 or loads[hi] <= (1 + tolerance) * mean:
            break
        best: tuple[float, int, int] | None = None
        for a in (e for e in range(len(to_rank)) if to_rank[e] == hi):
            for b in (e for e in range(len(to_rank)) if to_rank[e] == lo):
                d = load[a] - load[b]
                worst = max(loads[hi] - d, loads[lo] + d)
                if d > 0 and worst < loads[hi] and (best is None or worst < best[0]):
                    best = (worst, a, b)
        if best is None:
            break
        _, a, b = best
        d = load[a] - load[b]
        to_rank[a], to_rank[b] = lo, hi
        to_slot[a], to_slot[b] = to_slot[b], to_slot[a]
        loads[hi] -= d
        loads[lo] += d
    return ExpertPlacement(placement.num_experts, placement.num_ranks, tuple(to_rank), tuple(to_slot))
