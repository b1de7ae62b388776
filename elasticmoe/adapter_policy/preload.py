"""Preloading by usage probability while a server runs (CoServe §4.1, carried past start-up).

CoServe's executors load experts in descending usage probability until memory is full, once, at
start. A server whose adapters are registered while it runs fills its slots in registration order
instead, and an adapter registered once the slots are full waits in host memory however probable
it is: its first requests each wait for a copy.

`preload_choice` restores the order one adapter at a time, between demand swaps: the most probable
adapter out of the slots goes into a free slot, or in place of a strictly less probable resident
adapter, the first in the eviction policy's order among those it may displace:

- an adapter that has served no request since it was loaded (registration order put it there, or
  an earlier preload): displacing it can only help, since the slots then hold likelier adapters;
- any other idle adapter only when the candidate is likelier to be asked for than every other
  adapter out of the slots together (`outside_mass`). Otherwise bringing a hot adapter back right
  after a rare one displaced it is more often undone by the next rare request than used: in a
  closed loop over 16 Zipf-distributed adapters that doubled the switches (165 -> 294 at 2 slots)
  for a hit rate of 0.43 instead of 0.36.

Only pre-assessed probabilities count (profile or declaration; `TierView.probabilities` built
without observed rates), so every rank of an EP group makes the same choice, and each preload
raises the slots' total probability: preloads alone always stop.

Never displaced: pinned adapters (running requests use them) and queued ones (a waiting request
needs them). A preload is optional; a demand swap is not.
"""

from __future__ import annotations

from collections.abc import Iterable

from elasticmoe.adapter_policy.eviction import EvictionPolicy, TierView


def preload_choice(policy: EvictionPolicy, view: TierView, candidates: Iterable[str], num_free: int,
                   outside_mass: float = 1.0) -> tuple[str, str | None] | None:
    """(adapter to load, resident adapter it replaces or None for a free slot), or None when no
    candidate is worth a copy.

    `candidates`: adapters out of the slots (in host memory) whose probability was pre-assessed;
    the most probable one (ties: the first name) is chosen if its probability is above 0. It takes
    a free slot (`num_free` > 0), else the first resident in `policy`'s order that is evictable,
    not queued, strictly less probable and either unused since it was loaded or, when the
    candidate's probability exceeds `outside_mass` (that of the other adapters out of the slots
    together), any."""
    best = min(candidates, key=lambda n: (-view.probability(n), n), default=None)
    if best is None or view.probability(best) <= 0.0:
        return None
    if num_free > 0:
        return best, None
    likeliest_outside = view.probability(best) > outside_mass
    evictable = [n for n in view.evictable if n not in view.queued and view.graph.footprint(n) > 0
                 and (likeliest_outside or view.resident[n].used_seq == view.resident[n].loaded_seq)]
    if not evictable:
        return None
    victim = policy.order(view, evictable)[0]
    if view.probability(victim) >= view.probability(best):
        return None
    return best, victim
