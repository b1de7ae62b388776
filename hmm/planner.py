"""`plan(current, target) -> ScalePlan`: the cheapest way from one layout to another.

Pure: no Ray, no memory, no clock. The plan maximises zero-copy reuse and
minimises bytes moved:

- a device in both layouts reuses its non-expert tensors and its KV pool (the
  pool keeps its size and its block state survives the handover);
- a new device allocates its KV pool and receives every non-expert tensor by
  p2p from a current replica, sources chosen to spread the bytes sent (same
  node first, then the least-loaded sender);
- experts: unless the target names a placement, the balanced placement that
  keeps the most experts in place (`hmm.expert_moves`); kept experts are reused
  (or remapped when their slot changes), the rest are copied p2p from a current
  holder (the least-loaded one: with replicated experts, ep = 1, every device
  holds every expert, so a new replica gets them like dense tensors). A layout
  holds every tensor, so `plan` never reads disk;
  `load_plan` (the initial load) reads each tensor from disk exactly once;
- an offloading layout's expert cache (`Layout.cache_bytes`) belongs to one instance: every
  target device allocates a new, empty one and a kept device's old one is freed at commit, so
  the old and the new instance never share cache rows. Its host-tier expert rows move like any
  expert's but are not charged to the device's budget: a scale-down onto devices that cannot
  hold every expert is planned, not refused;
- everything the target does not need is freed at commit, after all other steps.

`TransitionOptions` switch mechanisms off for the paper's baselines and ablations
(defaults give the plan above):

- `zero_copy=False`: every target tensor on a kept device gets a second buffer,
  filled from the device's own copy (`LocalCopy`; from disk when `p2p` is off);
  a new, empty KV pool; the old buffers are freed at commit;
- `paged_remap=False`: on a device whose expert list changes, kept experts get a
  new buffer filled by `LocalCopy` (a new stack); unchanged stacks are reused;
- `p2p=False`: what a device lacks is read from disk (`DiskLoad`), not copied.

The target may use devices disjoint from the current ones (a fresh instance):
then nothing is reused and every current tensor is freed at commit.

`lost` devices of the current layout are gone with their memory (their node died): they
are never a source (a replicated tensor comes from a surviving replica; an expert only a
lost device held is read from disk), never freed, and never in the target.

`plan` raises PlanError when a device's peak during the transition (old
mappings + new allocations) exceeds its budget.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass

from elasticmoe.parallel.expert_placement import ExpertPlacement
from hmm.expert_moves import balance_expert_load, max_overlap_placement
from hmm.layout import DeviceSpec, Layout, TensorKey
from hmm.scale_plan import Alloc, DiskLoad, Free, LocalCopy, P2PCopy, Remap, Reuse, ScalePlan, Step
from hmm.transition_options import DEFAULT_OPTIONS, TransitionOptions


class PlanError(ValueError):
    """The target cannot be reached within the devices' budgets."""


@dataclass(frozen=True, slots=True)
class TargetConfig:
    """A configuration to scale to: dp = len(devices), rank r on devices[r]; ep = dp (expert
    parallel) or 1 (replicated experts: data-parallel replicas, each holding every expert).

    `placement=None` asks the planner for the balanced placement that moves the
    fewest experts (replicated: every expert at its own index); with `expert_load` (each
    expert's expected load, e.g. tokens routed to it) that placement is then balanced by load
    (`hmm.expert_moves.balance_expert_load`). `kv_bytes` sizes the KV pool of devices new to the layout
    (None: budget minus weights); kept devices keep their pool.
    """

    devices: tuple[DeviceSpec, ...]
    dp: int
    ep: int
    placement: ExpertPlacement | None = None
    kv_bytes: int | None = None
    expert_load: tuple[float, ...] | None = None

    def __post_init__(self) -> None:
        ids = [d.device_id for d in self.devices]
        if len(set(ids)) != len(ids):
            raise ValueError(f"target: device ids must be distinct, got {ids}")
        if self.dp != len(self.devices) or self.ep not in (1, self.dp):
            raise ValueError(
                f"target: needs dp == number of devices and ep == dp or 1, got {self.dp}, {self.ep}, {len(ids)}"
            )
        if self.placement is not None and self.placement.num_ranks != self.ep:
            raise ValueError(f"target: placement has {self.placement.num_ranks} ranks, ep is {self.ep}")
        if self.kv_bytes is not None and self.kv_bytes < 0:
            raise ValueError(f"target: kv_bytes must be >= 0, got {self.kv_bytes}")


def scale_target(
    current: Layout,
    dp: int,
    new_devices: Sequence[DeviceSpec] = (),
    keep_device_ids: Sequence[int] | None = None,
    placement: ExpertPlacement | None = None,
    kv_bytes: int | None = None,
    leaving: Collection[int] = (),
    replicated: bool = False,
    expert_load: Sequence[float] | None = None,
) -> TargetConfig:
    """Target for DP/EP `dp` (`replicated`: dp replicas, ep = 1): scale-up appends `new_devices`;
    scale-down keeps `keep_device_ids` (default: the lowest device ids), in their current rank order.
    `leaving`: current devices the target must not use (a node being drained, or lost); the
    others count as the current ones, so a target of the same dp replaces them with new ones.
    `expert_load`: see `TargetConfig`."""
    gone = set(leaving)
    staying = tuple(d for d in current.devices if d.device_id not in gone)
    if dp >= len(staying):
        if len(new_devices) < dp - len(staying):
            raise ValueError(f"target: dp={dp} needs {dp - len(staying)} new devices, got {len(new_devices)}")
        devices = staying + tuple(new_devices[: dp - len(staying)])
    else:
        keep = set(keep_device_ids if keep_device_ids is not None else sorted(d.device_id for d in staying)[:dp])
        devices = tuple(d for d in staying if d.device_id in keep)
        if len(devices) != dp:
            raise ValueError(
                f"target: keep {dp} of the current devices {current.device_ids}, got {sorted(keep)}"
            )
    load = tuple(float(x) for x in expert_load) if expert_load is not None else None
    return TargetConfig(devices, dp, 1 if replicated else dp, placement, kv_bytes, load)


def target_layout(current: Layout, target: TargetConfig) -> Layout:
    """The layout `plan` moves to (kept devices keep their KV pool size)."""
    ids = [d.device_id for d in target.devices]
    if target.placement is not None:
        placement = target.placement
    elif target.ep == 1:
        placement = ExpertPlacement.single(current.sizes.num_experts)
    else:
        placement = max_overlap_placement(
            {d: current.local_experts(d) for d in current.device_ids},
            ids,
            current.sizes.num_experts,
            {d.device_id: d.node_id for d in (*current.devices, *target.devices)},
        )
        if target.expert_load is not None:
            placement = balance_expert_load(placement, target.expert_load)
    kv, cache = [], []
    for rank, dev in enumerate(target.devices):
        weight = current.sizes.weight_bytes(len(placement.local_expert_ids(rank if target.ep > 1 else 0)))
        if current.offloads:  # one expert cache size everywhere; the experts are host tier
            cache.append(max(current.cache_bytes))
            weight = current.sizes.dense_bytes + cache[-1]
        if dev.device_id in current.device_ids:
            kv.append(current.kv_bytes[current.rank_of(dev.device_id)])
        elif target.kv_bytes is not None:
            kv.append(target.kv_bytes)
        elif weight > dev.budget_bytes:
            raise PlanError(
                f"device {dev.device_id}: weights {weight} B exceed its budget {dev.budget_bytes} B"
            )
        else:
            kv.append(dev.budget_bytes - weight)
    try:
        return Layout(current.sizes, target.devices, placement, tuple(kv), tuple(cache), current.host_experts)
    except ValueError as e:
        raise PlanError(str(e)) from e


def plan(
    current: Layout,
    target: TargetConfig,
    options: TransitionOptions = DEFAULT_OPTIONS,
    lost: Collection[int] = (),
) -> ScalePlan:
    """Steps from `current` to `target` under `options` (see the module docstring);
    validated (minimal only with the default options). `lost`: current devices gone with
    their memory."""
    gone = frozenset(lost)
    if gone & {d.device_id for d in target.devices}:
        raise PlanError(f"plan: the target uses lost devices {sorted(gone)}")
    new = target_layout(current, target)
    alive = [d for d in current.device_ids if d not in gone]
    sent: dict[int, int] = dict.fromkeys(alive, 0)
    node = {d.device_id: d.node_id for d in (*current.devices, *new.devices)}
    reuse: list[Step] = []
    fill: list[Step] = []
    expert_fill: list[Step] = []
    local: list[Step] = []  # second buffers of kept tensors (non-default options only)
    renewed: set[tuple[int, TensorKey]] = set()  # (device, key) whose old buffer is freed at commit
    for d in new.device_ids:
        have = current.tensors(d) if d in current.device_ids else {}
        stack_changed = d not in current.device_ids or current.local_experts(d) != new.local_experts(d)
        for key, nbytes in new.tensors(d).items():
            if key.kind == "cache":  # one instance's private pool: a new one per layout
                fill.append(Alloc(d, key, nbytes))
                if key in have:
                    renewed.add((d, key))
                continue
            if key in have:
                in_place = options.zero_copy and (
                    key.kind != "expert" or options.paged_remap or not stack_changed
                )
                if in_place:
                    slots = (
                        (current.slot(key.expert_id), new.slot(key.expert_id))
                        if key.kind == "expert"
                        else (0, 0)
                    )
                    moved = slots[0] != slots[1]
                    reuse.append(Remap(d, key, *slots, nbytes) if moved else Reuse(d, key, nbytes))
                    continue
                renewed.add((d, key))
                local.append(Alloc(d, key, nbytes))
                if key.is_pool:
                    continue
                # Without zero-copy and p2p the new copy is loaded like a fresh instance's.
                from_disk = not options.zero_copy and not options.p2p
                local.append(DiskLoad(d, key, nbytes) if from_disk else LocalCopy(d, key, nbytes))
            elif key.kind == "kv":
                fill.append(Alloc(d, key, nbytes))
            elif key.kind == "expert":
                holders = [s for s in current.holders(key.expert_id) if s not in gone]
                if not options.p2p or not holders:
                    expert_fill += [Alloc(d, key, nbytes), DiskLoad(d, key, nbytes)]
                    continue
                src = min(holders, key=lambda s: (node[s] != node[d], sent[s], s))
                sent[src] += nbytes
                expert_fill += [Alloc(d, key, nbytes), P2PCopy(src, d, key, nbytes)]
    # Non-expert tensors for new devices, largest first, each from the least-loaded replica.
    for d in new.device_ids:
        if d in current.device_ids:
            continue
        for key, nbytes in sorted(_dense(new, d).items(), key=lambda kv: (-kv[1], kv[0].name)):
            if not options.p2p or not alive:
                fill += [Alloc(d, key, nbytes), DiskLoad(d, key, nbytes)]
                continue
            src = min(alive, key=lambda s: (node[s] != node[d], sent[s], s))
            sent[src] += nbytes
            fill += [Alloc(d, key, nbytes), P2PCopy(src, d, key, nbytes)]
    steps = (*reuse, *fill, *local, *expert_fill, *_frees(current, new, renewed, gone))
    result = ScalePlan(current, new, steps, options, gone)
    over = result.over_budget()
    if over:
        raise PlanError(f"plan: peak memory exceeds the budget of devices {over} (device: excess bytes)")
    result.validate(minimal=options.is_default)
    return result


def load_plan(target: Layout) -> ScalePlan:
    """Initial load: each tensor is read from disk once (replicated ones by the
    replica that has read the fewest bytes so far), the other replicas get it by p2p."""
    holders: dict[TensorKey, list[int]] = {}
    sizes: dict[TensorKey, int] = {}
    for d in target.device_ids:
        for key, nbytes in target.tensors(d).items():
            holders.setdefault(key, []).append(d)
            sizes[key] = nbytes
    read = dict.fromkeys(target.device_ids, 0)
    load: list[Step] = [Alloc(d, k, n) for d in target.device_ids for k, n in target.tensors(d).items()]
    copy: list[Step] = []
    for key in sorted(holders, key=lambda k: (-sizes[k], k.name, k.expert or 0)):
        if key.is_pool:
            continue
        loader = min(holders[key], key=lambda d: (read[d], d))
        read[loader] += sizes[key]
        load.append(DiskLoad(loader, key, sizes[key]))
        copy += [P2PCopy(loader, d, key, sizes[key]) for d in holders[key] if d != loader]
    result = ScalePlan(None, target, (*load, *copy))
    result.validate()
    return result


def restore_plan(layout: Layout, device_id: int) -> ScalePlan:
    """Refill one device of `layout` that lost everything (its worker died): an empty KV pool,
    every replicated tensor (non-expert; experts too when the layout replicates them) copied from a
    live replica (same node first, spread over the senders), and what only it held (its experts)
    read from disk. The other devices only send: the plan starts from `layout` and ends at it."""
    if device_id not in layout.device_ids:
        raise ValueError(f"restore: device {device_id} is not in the layout {layout.device_ids}")
    node = {d.device_id: d.node_id for d in layout.devices}
    others = [d for d in layout.device_ids if d != device_id]
    sent = dict.fromkeys(others, 0)
    steps: list[Step] = []
    for key, nbytes in sorted(layout.tensors(device_id).items(), key=lambda kv: (-kv[1], kv[0].name)):
        steps.append(Alloc(device_id, key, nbytes))
        if key.is_pool:
            continue
        if (key.kind == "expert" and not layout.is_replicated) or not others:
            steps.append(DiskLoad(device_id, key, nbytes))
            continue
        src = min(others, key=lambda s: (node[s] != node[device_id], sent[s], s))
        sent[src] += nbytes
        steps.append(P2PCopy(src, device_id, key, nbytes))
    return ScalePlan(layout, layout, tuple(steps))


def naive_full_copy_plan(current: Layout, target: TargetConfig) -> ScalePlan:
    """Baseline: the new instance gets a second full copy (weights and KV pools)
    loaded from disk while the old one serves; every old buffer is freed at commit.
    Passes `validate(minimal=False)`; never checked against budgets. The same steps
    (in another order) as `plan(..., TransitionOptions(zero_copy=False, p2p=False))`."""
    new = target_layout(current, target)
    steps: list[Step] = []
    for d in new.device_ids:
        for key, nbytes in new.tensors(d).items():
            steps.append(Alloc(d, key, nbytes))
            if not key.is_pool:
                steps.append(DiskLoad(d, key, nbytes))
    for d in current.device_ids:
        steps += [Free(d, key, nbytes) for key, nbytes in current.tensors(d).items()]
    return ScalePlan(current, new, tuple(steps))


def _dense(layout: Layout, device_id: int) -> dict[TensorKey, int]:
    return {k: b for k, b in layout.tensors(device_id).items() if k.kind == "dense"}


def _frees(
    current: Layout, new: Layout, renewed: Collection[tuple[int, TensorKey]] = (), lost: Collection[int] = ()
) -> list[Step]:
    """Deferred to commit: whatever each current device holds that the target does not
    keep in place (not at all, or `renewed`: the target got a new buffer of it). Lost devices
    hold nothing any more."""
    frees: list[Step] = []
    for d in current.device_ids:
        if d in lost:
            continue
        keep = new.tensors(d)
        frees += [
            Free(d, key, nbytes)
            for key, nbytes in current.tensors(d).items()
            if key not in keep or (d, key) in renewed
        ]
    return frees
