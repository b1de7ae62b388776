"""The steps of a scaling transition and the invariants a plan must keep.

A `ScalePlan` goes from `current` (None: nothing loaded yet) to `target`. Its
steps run in order; `Free` steps come last and run only at `commit`, so every
old mapping stays valid while the old instance keeps serving. Expert steps
(`Reuse`, `Remap`, `P2PCopy`, `DiskLoad`) build the device's *new* virtual expert
tensor at the key's target slot; the old virtual tensor is untouched until commit.

Buffers: `Alloc` of a key a device already holds makes a second buffer of it
(only baselines and ablations do this, see `TransitionOptions`), which a
`LocalCopy` fills from the device's older buffer; `Free` releases a key's
oldest buffer.
"""

from __future__ import annotations

from dataclasses import dataclass

from hmm.layout import Layout, TensorKey
from hmm.transition_options import DEFAULT_OPTIONS, TransitionOptions


class InvalidPlan(ValueError):
    """A plan breaks one of the invariants checked by `ScalePlan.validate`."""


@dataclass(frozen=True, slots=True)
class Reuse:
    """Zero-copy: the tensor already sits on `device` (at its target slot)."""

    device: int
    key: TensorKey
    nbytes: int


@dataclass(frozen=True, slots=True)
class Remap:
    """An expert that stays on `device` but moves slot: remap its pages, no copy."""

    device: int
    key: TensorKey
    from_slot: int
    to_slot: int
    nbytes: int

    def __post_init__(self) -> None:
        if (
            self.key.kind != "expert"
            or self.from_slot == self.to_slot
            or min(self.from_slot, self.to_slot) < 0
        ):
            raise ValueError(f"remap {self.key}: an expert key and two different slots >= 0")

    @property
    def layer(self) -> int | None:
        return self.key.layer

    @property
    def expert(self) -> int | None:
        return self.key.expert


@dataclass(frozen=True, slots=True)
class Alloc:
    """Allocate an empty buffer (a KV pool needs nothing more)."""

    device: int
    key: TensorKey
    nbytes: int


@dataclass(frozen=True, slots=True)
class P2PCopy:
    """Fill `dst_device`'s allocated buffer from `src_device`'s copy."""

    src_device: int
    dst_device: int
    key: TensorKey
    nbytes: int

    def __post_init__(self) -> None:
        if self.src_device == self.dst_device:
            raise ValueError(f"p2p {self.key}: source and destination are both device {self.src_device}")


@dataclass(frozen=True, slots=True)
class LocalCopy:
    """Fill `device`'s newest (empty) buffer of `key` from its older filled one:
    a device-internal memcpy, used when a kept tensor may not be reused in place."""

    device: int
    key: TensorKey
    nbytes: int

    def __post_init__(self) -> None:
        if self.key.is_pool:
            raise ValueError("local copy: a new pool (KV, expert cache) starts empty; it is never copied")


@dataclass(frozen=True, slots=True)
class DiskLoad:
    """Fill `device`'s allocated buffer from the checkpoint on disk."""

    device: int
    key: TensorKey
    nbytes: int


@dataclass(frozen=True, slots=True)
class Free:
    """Release the key's oldest buffer on `device`; deferred to commit."""

    device: int
    key: TensorKey
    nbytes: int


Step = Reuse | Remap | Alloc | P2PCopy | LocalCopy | DiskLoad | Free


@dataclass(frozen=True, slots=True)
class ScalePlan:
    """Ordered steps from `current` to `target`, with summaries and `validate()`.

    `options` are the mechanisms the plan was made with; the device workers
    stage with the same options, so what they allocate matches the plan.
    """

    current: Layout | None
    target: Layout
    steps: tuple[Step, ...]
    options: TransitionOptions = DEFAULT_OPTIONS
    # Devices of `current` that are gone with their memory (their node died): nothing is read
    # from them, nothing is freed on them, no call reaches them (`device_ids` leaves them out).
    lost: frozenset[int] = frozenset()

    def __post_init__(self) -> None:
        if any(getattr(s, "nbytes", 0) < 0 for s in self.steps):
            raise ValueError("plan: step sizes must be >= 0")
        if self.lost & set(self.target.device_ids):
            raise ValueError(f"plan: lost devices {sorted(self.lost)} cannot be in the target")

    def _sum(self, *kinds: type) -> int:
        return sum(s.nbytes for s in self.steps if isinstance(s, kinds))

    @property
    def bytes_p2p(self) -> int:
        return self._sum(P2PCopy)

    @property
    def bytes_disk(self) -> int:
        return self._sum(DiskLoad)

    @property
    def bytes_local_copy(self) -> int:
        return self._sum(LocalCopy)

    @property
    def bytes_moved(self) -> int:
        """Bytes that cross a device boundary (p2p or from disk); local copies are not moved."""
        return self._sum(P2PCopy, DiskLoad)

    @property
    def bytes_reused(self) -> int:
        return self._sum(Reuse, Remap)

    @property
    def bytes_allocated(self) -> int:
        return self._sum(Alloc)

    @property
    def num_experts_moved(self) -> int:
        """Distinct (destination device, expert) pairs filled by a copy."""
        copies = [s for s in self.steps if isinstance(s, P2PCopy | DiskLoad)]
        return len({(_dst(s), s.key.expert) for s in copies if s.key.kind == "expert"})

    def bytes_sent_by_device(self) -> dict[int, int]:
        sent: dict[int, int] = {}
        for s in self.steps:
            if isinstance(s, P2PCopy):
                sent[s.src_device] = sent.get(s.src_device, 0) + s.nbytes
        return sent

    def device_ids(self) -> tuple[int, ...]:
        """Every live device the plan touches (lost ones are left out)."""
        ids = set(self.target.device_ids) | set(self.current.device_ids if self.current else ())
        return tuple(sorted(ids - self.lost))

    def peak_bytes(self) -> dict[int, int]:
        """Per device, the most bytes charged to its budget at any point (old mappings live until
        commit; host-tier expert rows of an offloading layout are not charged)."""
        current = self.current
        used = {d: current.total_bytes(d) if current and d in current.device_ids else 0 for d in self.device_ids()}
        peak = dict(used)
        for s in self.steps:
            if isinstance(s, Alloc | Free) and self.target.charged(s.key):
                used[s.device] += s.nbytes if isinstance(s, Alloc) else -s.nbytes
                peak[s.device] = max(peak[s.device], used[s.device])
        return peak

    def over_budget(self) -> dict[int, int]:
        """device -> bytes by which its peak exceeds its budget (devices of either layout)."""
        budgets = {d.device_id: d.budget_bytes for d in self.target.devices}
        if self.current:
            budgets.update({d.device_id: d.budget_bytes for d in self.current.devices})
        return {d: p - budgets[d] for d, p in self.peak_bytes().items() if p > budgets[d]}

    def validate(self, minimal: bool = True) -> None:
        """Raise InvalidPlan unless, simulating the steps in order:

        - every read (Reuse, Remap, copy source) hits a filled buffer that exists
          then (never one an earlier step freed); copies fill allocated buffers;
          a LocalCopy reads an older filled buffer of the key on its device and
          fills the newest one;
        - `Free` steps come after all others and never free a target key's last buffer;
        - every target key ends with one filled buffer on its device, at its target
          slot (a Remap when it moves slot), and nothing outside the target is left;
        - with `minimal`: no second buffer of a held key, no disk load of a key
          some device holds, and every kept tensor is declared by a Reuse/Remap.

        Lost devices hold nothing from the start (their memory is gone).
        """
        cur = {d: self.current.tensors(d) for d in self.current.device_ids if d not in self.lost} if self.current else {}
        tgt = {d: self.target.tensors(d) for d in self.target.device_ids}
        bufs = {
            (d, k): [True] for d, keys in cur.items() for k in keys
        }  # filled flag per buffer, oldest first
        held = {
            k for keys in cur.values() for k in keys
        }  # keys filled somewhere (nothing is freed before commit)
        freed: set[tuple[int, TensorKey]] = set()
        placed: set[tuple[int, TensorKey]] = set()
        committing = False

        def read(i: int, d: int, k: TensorKey) -> None:
            if not any(bufs.get((d, k), ())):
                why = "freed by an earlier step" if (d, k) in freed else "not there"
                raise InvalidPlan(f"step {i}: reads {k} on device {d}, which is {why}")

        for i, s in enumerate(self.steps):
            if isinstance(s, Free):
                committing = True
                b = bufs.get((s.device, s.key))
                if not b:
                    raise InvalidPlan(f"step {i}: frees {s.key} on device {s.device}, which it does not hold")
                if s.key in tgt.get(s.device, {}) and len(b) == 1:
                    raise InvalidPlan(f"step {i}: frees target tensor {s.key} on device {s.device}")
                b.pop(0)
                if not b:
                    del bufs[(s.device, s.key)]
                    freed.add((s.device, s.key))
                continue
            src = (s.src_device if isinstance(s, P2PCopy) else s.device, s.key)
            if isinstance(s, Reuse | Remap | P2PCopy | LocalCopy) and src in freed:
                read(i, *src)  # raises: the tensor was freed by an earlier step
            if committing:
                raise InvalidPlan(f"step {i}: {type(s).__name__} after a Free; frees run at commit only")
            dst = _dst(s)
            if s.key not in tgt.get(dst, {}):
                raise InvalidPlan(f"step {i}: {s.key} is not a target tensor of device {dst}")
            if isinstance(s, Alloc):
                # An expert cache is private to one instance: every layout allocates a new one.
                if minimal and (dst, s.key) in bufs and s.key.kind != "cache":
                    raise InvalidPlan(f"step {i}: second buffer of {s.key} on device {dst}")
                if s.nbytes != tgt[dst][s.key]:
                    raise InvalidPlan(
                        f"step {i}: allocates {s.nbytes} B for {s.key}, target has {tgt[dst][s.key]}"
                    )
                is_pool = s.key.is_pool  # a pool needs no filling
                bufs.setdefault((dst, s.key), []).append(is_pool)
                if is_pool:
                    placed.add((dst, s.key))
                continue
            if isinstance(s, Reuse | Remap):
                read(i, dst, s.key)
                if s.key.kind == "expert" and self.current is not None:
                    old, new = self.current.slot(s.key.expert_id), self.target.slot(s.key.expert_id)
                    if isinstance(s, Reuse) and old != new:
                        raise InvalidPlan(f"step {i}: {s.key} moves from slot {old} to {new}; a Reuse cannot")
                    if isinstance(s, Remap) and (s.from_slot, s.to_slot) != (old, new):
                        raise InvalidPlan(
                            f"step {i}: {s.key} moves from slot {old} to {new}, not as the Remap says"
                        )
            else:  # P2PCopy | LocalCopy | DiskLoad fill the newest buffer
                if isinstance(s, P2PCopy):
                    read(i, s.src_device, s.key)
                elif isinstance(s, DiskLoad) and minimal and s.key in held:
                    raise InvalidPlan(f"step {i}: disk-loads {s.key}, which a device already holds")
                b = bufs.get((dst, s.key))
                if not b or b[-1]:
                    raise InvalidPlan(f"step {i}: copies {s.key} into device {dst} without an empty buffer")
                if isinstance(s, LocalCopy) and not any(b[:-1]):
                    raise InvalidPlan(
                        f"step {i}: local copy of {s.key} on device {dst} without an older filled buffer"
                    )
                b[-1] = True
                held.add(s.key)
            placed.add((dst, s.key))
        for d, keys in tgt.items():
            for k in keys:
                if bufs.get((d, k)) != [True]:
                    raise InvalidPlan(f"end: target tensor {k} is not on device {d} exactly once, filled")
                if minimal and (d, k) not in placed:
                    raise InvalidPlan(f"end: no step declares how target tensor {k} gets to device {d}")
        extra = [(d, k) for d, k in bufs if k not in tgt.get(d, {})]
        if extra:
            raise InvalidPlan(
                f"end: {len(extra)} tensors outside the target are never freed, e.g. {extra[0]}"
            )


def _dst(s: Step) -> int:
    return s.dst_device if isinstance(s, P2PCopy) else s.device
