"""How a device's memory divides between the KV cache (batch inference), LoRA slots, ESFT slots
and, with offloading, the expert cache: CoServe §4.4, as pure functions over a `Profile`.

Items (LoRA adapters, ESFT adapters, offloaded base experts) are sorted by usage probability,
descending: the x-axis of the usage CDF (Fig. 11). Loading the first n of them costs their
footprints; the rest of the budget holds KV for batch inference. The LoRA and ESFT items loaded
are the slots of their kind (an engine swaps the other adapters through them, so a kind with
adapters gets at least one slot), the experts loaded the expert cache's rows.

- **Limited computation** ("the maximum batch size ... occupies minimal memory"): when the KV of
  one full batch (`max_batch` requests of `tokens_per_request` tokens) is at most
  `small_batch_fraction` of the memory, that KV is reserved and every item that fits is loaded
  (KV gets what is left over after the last item that fits).
- **Sufficient computation**: the decay-window search (`decay_window_search`) over the number of
  items loaded, probing a throughput at each window's upper bound; the throughput comes from
  `measure` (a sample run, as in the paper) or, by default, from the profile's model
  (`estimate_throughput`). The rest of the memory is KV.

Request splitting (§4.2) then caps a batch at min(profiled max batch, requests the KV holds):
`MemorySplit.max_num_seqs`.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from elasticmoe.adapter_policy.fitting import linear_fit
from elasticmoe.adapter_policy.profile import BASE_KIND, MemorySplit, Profile
from elasticmoe.adapter_policy.usage import check_probability

SWAPPABLE_KINDS = ("lora", "esft", "expert")  # kinds whose items the search decides to keep resident
SLOT_KINDS = ("lora", "esft")  # adapter kinds served through slots: one at least where adapters exist


@dataclass(frozen=True, slots=True)
class CacheItem:
    """Something the tier may keep resident: its kind's footprint and load latency come from the
    profile; `probability` is the chance that a request needs it."""

    name: str
    kind: str
    probability: float

    def __post_init__(self) -> None:
        check_probability(self.probability, f"probability of {self.name!r}")


@dataclass(frozen=True, slots=True)
class DecayWindow:
    """Where the decay-window search stopped: the window [lower, upper] in percent of the items
    (the usage CDF's x-axis), the same in items, the number of items chosen inside it, and every
    (items loaded, throughput) probe in order."""

    lower_pct: float
    upper_pct: float
    lower: int
    upper: int
    choice: int
    probes: tuple[tuple[int, float], ...]


def sorted_items(items: Iterable[CacheItem], footprint: Callable[[CacheItem], int] | None = None) -> list[CacheItem]:
    """Descending probability; ties: the smaller footprint, then the name."""
    size = footprint or (lambda _: 0)
    return sorted(items, key=lambda i: (-i.probability, size(i), i.name))


def _items_at(pct: float, num_items: int) -> int:
    return min(num_items, int(pct * num_items / 100.0 + 0.5))


def decay_window_search(
    measure: Callable[[int], float],
    num_items: int,
    initial_window: float = 15.0,
    error_margin: float = 0.05,
    rng: random.Random | None = None,
) -> DecayWindow:
    """CoServe §4.4: slide a decaying window over the usage CDF and stop where the throughput
    leaves its upward trend.

    The window starts at [0, `initial_window`] percent of the items; each slide starts the next
    window at the previous upper bound and multiplies its size by the decay factor
    `1 - initial_window / 100` (Eq. 1; the windows add up to 100 %). At each upper bound,
    `measure(n)` gives the throughput with the first n items loaded. The first N throughputs fit
    `f(N) = k N + b` (Eq. 2; with one value, a flat line); the window whose throughput falls
    short of the prediction, `(f(N + 1) - actual) / f(N + 1) > error_margin` (Eq. 3), is
    selected; a window narrower than one item slides on to the next that adds one, and the search
    also stops once the window reaches every item.
    Inside the selected window the paper picks at random (the values there differ little):
    `rng` if given, else the middle, for reproducible results.
    """
    if not 0 < initial_window < 100:
        raise ValueError(f"initial_window: must be in (0, 100) percent, got {initial_window}")
    if not 0 <= error_margin < 1:
        raise ValueError(f"error_margin: must be in [0, 1), got {error_margin}")
    if num_items < 0:
        raise ValueError(f"num_items: must be >= 0, got {num_items}")
    if num_items == 0:
        return DecayWindow(0.0, 0.0, 0, 0, 0, ())
    decay = 1 - initial_window / 100
    lower, size = 0.0, float(initial_window)
    upper = size
    values: list[float] = []
    probes: list[tuple[int, float]] = []
    while True:
        n = _items_at(upper, num_items)
        actual = float(measure(n))
        probes.append((n, actual))
        if values:
            k, b = linear_fit([float(i) for i in range(1, len(values) + 1)], values)
            expected = k * (len(values) + 1) + b
            if expected <= 0 or (expected - actual) / expected > error_margin:
                break  # Eq. 3: the throughput left its upward trend in this window
        values.append(actual)
        if n >= num_items:
            break
        lower = upper
        # A window narrower than one item has nothing new to probe: it slides (and decays) on. The
        # windows add up to 100 %, so the upper bound reaches every item in the end.
        while _items_at(upper, num_items) == n:
            size *= decay
            upper += size
    lo, hi = _items_at(lower, num_items), n
    choice = rng.randint(lo, hi) if rng is not None else (lo + hi) // 2
    return DecayWindow(lower, upper, lo, hi, choice, tuple(probes))


def _max_batch(profile: Profile, kinds: Iterable[str]) -> int:
    return min(profile.kinds[k].max_batch for k in {BASE_KIND, *kinds} if k in profile.kinds)


def estimate_throughput(profile: Profile, items: Sequence[CacheItem], num_loaded: int, memory_bytes: int) -> float:
    """Requests per second with the first `num_loaded` of `items` (sorted) resident and the rest of
    `memory_bytes` as KV cache, by the profile's model:

        b = min(max_batch, KV bytes // one request's KV)        (0 requests fit: 0)
        per-request switch s = sum over items not loaded of probability * load_s of its kind
        throughput = b / (K * b + B + b * s)

    K and B are the request mix's: each adapter item's kind weighted by its probability, the base
    model by what remains. More items resident means fewer switches; fewer bytes for KV means
    smaller batches: the trade-off of §3.3."""
    loaded, rest = items[:num_loaded], items[num_loaded:]
    kv = memory_bytes - sum(profile.kinds[i.kind].footprint_bytes for i in loaded)
    requests = [i for i in items if i.kind != "expert"]  # requests name adapters; experts ride along
    batch = min(_max_batch(profile, (i.kind for i in requests if i.probability > 0)),
                max(0, kv) // profile.request_kv_bytes)
    if batch < 1:
        return 0.0
    p_adapters = min(1.0, sum(i.probability for i in requests))
    base = profile.kinds[BASE_KIND]
    k = (1 - p_adapters) * base.k_s + sum(i.probability * profile.kinds[i.kind].k_s for i in requests)
    b = (1 - p_adapters) * base.b_s + sum(i.probability * profile.kinds[i.kind].b_s for i in requests)
    switch = sum(i.probability * profile.kinds[i.kind].load_s for i in rest)
    latency = k * batch + b + batch * switch
    return batch / latency if latency > 0 else float("inf")


def profile_items(profile: Profile) -> list[CacheItem]:
    """The profile's swappable items (LoRA adapters, offloaded experts) with their probabilities."""
    return [CacheItem(name, kind, profile.usage_probability.get(name, 0.0))
            for name, kind in sorted(profile.adapter_kind.items()) if kind in SWAPPABLE_KINDS]


def plan_memory_split(
    profile: Profile,
    budget_bytes: int,
    items: Iterable[CacheItem] | None = None,
    *,
    initial_window: float = 15.0,
    error_margin: float = 0.05,
    small_batch_fraction: float = 0.25,
    measure: Callable[[int], float] | None = None,
) -> MemorySplit:
    """Divide `budget_bytes` (KV + LoRA slots + ESFT slots + expert cache) by §4.4 (see the module
    docstring). `items` default to the profile's; `measure(n)` to `estimate_throughput`. Raises
    `ValueError` if the budget cannot hold one request's KV and, for each adapter kind with
    adapters, one slot of it."""
    if not 0 < small_batch_fraction < 1:
        raise ValueError(f"small_batch_fraction: must be in (0, 1), got {small_batch_fraction}")
    given = profile_items(profile) if items is None else list(items)
    unknown = {i.kind for i in given} - set(profile.kinds)
    if unknown:
        raise ValueError(f"items: kinds {sorted(unknown)} are not profiled")
    kinds = profile.kinds

    def footprint(item: CacheItem) -> int:
        return kinds[item.kind].footprint_bytes

    ordered = sorted_items(given, footprint)
    swappable = [i for i in ordered if i.kind in SWAPPABLE_KINDS]
    one_request = profile.request_kv_bytes
    if budget_bytes < one_request:
        raise ValueError(f"budget_bytes: {budget_bytes} cannot hold one request's KV ({one_request} bytes)")
    prefix = [0]
    for item in swappable:
        prefix.append(prefix[-1] + footprint(item))
    max_batch = _max_batch(profile, (i.kind for i in swappable if i.kind != "expert" and i.probability > 0))

    def fits(reserved_kv: int) -> int:
        """How many leading items fit beside `reserved_kv` bytes of KV."""
        return max(n for n in range(len(prefix)) if prefix[n] <= budget_bytes - reserved_kv)

    window: tuple[int, int] | None = None
    if max_batch * one_request <= small_batch_fraction * budget_bytes:
        strategy, num_loaded = "limited", fits(max_batch * one_request)
    else:
        strategy, limit = "decay_window", fits(one_request)
        probe = measure or (lambda n: estimate_throughput(profile, swappable, n, budget_bytes))
        found = decay_window_search(probe, limit, initial_window, error_margin)
        num_loaded, window = found.choice, (found.lower, found.upper)
    loaded = swappable[:num_loaded]
    slots = {kind: sum(i.kind == kind for i in loaded) for kind in SLOT_KINDS}
    slot_bytes = {kind: kinds[kind].footprint_bytes if kind in kinds else 0 for kind in SLOT_KINDS}
    used = prefix[num_loaded]
    for kind in SLOT_KINDS:
        if slots[kind] == 0 and any(i.kind == kind for i in swappable):
            slots[kind] = 1  # the engine needs one slot to serve the kind's adapters at all
            used += slot_bytes[kind]
            if used + one_request > budget_bytes:
                raise ValueError(f"budget_bytes: {budget_bytes} cannot hold one {_SLOT_NAMES[kind]} slot "
                                 f"beside the items loaded and one request's KV")
    num_experts = sum(i.kind == "expert" for i in loaded)
    expert_row = kinds["expert"].footprint_bytes if "expert" in kinds else 0
    kv = budget_bytes - used
    return MemorySplit(budget_bytes, kv, slots["lora"], slot_bytes["lora"], num_experts, expert_row,
                       slots["esft"] * slot_bytes["esft"], max(1, min(max_batch, kv // one_request)), strategy,
                       window, num_esft_slots=slots["esft"])


_SLOT_NAMES = {"lora": "LoRA", "esft": "ESFT"}
