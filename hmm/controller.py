"""`HMMController`: the control plane of the HMM (the layout on the device registry, plans).

A plain class, testable with in-process `DeviceWorker`s; `HMMControllerActor`
is the same class as a Ray actor, whose workers are `DeviceWorkerActor`s. The workers
themselves (start, stop, loss, replacement, the gloo group) are `hmm.device_workers`'
`DeviceWorkers`, which `HMMController` extends with the layout they hold.

`execute(plan)` runs a `ScalePlan` in three phases, each concurrent across devices:
1. stage (Alloc / Reuse / Remap): every device of either layout `begin`s its
   target state with the plan's `TransitionOptions`; kept tensors are reused
   zero-copy, kept experts are mapped at their target slots from the same pages;
   the keys each device reports to fill must equal the plan's copies into it;
2. disk and local (DiskLoad, LocalCopy): each device reads its subset of the
   checkpoint and copies kept tensors into their new buffers (baselines only);
3. p2p (P2PCopy): same-node copies by the fast path, others over gloo.
Old mappings stay valid until `commit`, which runs the plan's Free steps (each
device frees what its target does not hold). Any failure aborts: every device
releases what the plan allocated, and the old layout and accounting are exactly
as before. `unload` tears the model down (workers and page pools stay), so a
later `load` starts over from disk: the cold-restart baseline.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, replace

import ray
import torch

from elasticmoe.config import ModelConfig
from elasticmoe.models.registry import model_family
from elasticmoe.models.weights import ParamSpec, with_adapter_slots
from elasticmoe.parallel.expert_placement import ExpertPlacement
from hmm.device_memory import DEVICE_PAGE_SIZE, AdapterRow, Handle
from hmm.device_workers import DeviceWorkers, P2PMode
from hmm.layout import Layout, ModelSizes, TensorKey, layout_for
from hmm.memory import MemoryUsage
from hmm.memory.page_table import SlotPages
from hmm.memory.segments import DEFAULT_PREFIX
from hmm.p2p import HandleCopy, Transfer
from hmm.planner import TargetConfig, load_plan, plan, restore_plan
from hmm.scale_plan import DiskLoad, Free, InvalidPlan, LocalCopy, P2PCopy, ScalePlan
from hmm.transition_options import DEFAULT_OPTIONS, TransitionOptions

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class EsftEntry:
    """A registered ESFT adapter: its slot, files and tuned experts (layer -> ids)."""

    name: str
    slot: int
    path: str
    experts: dict[int, tuple[int, ...]]


class HMMController(DeviceWorkers):
    """The current layout over the device workers (`DeviceWorkers`, their registry); runs plans on them.

    Invariant: between `execute` and `commit`/`abort` the current layout and its
    handles are unchanged and valid; `commit` makes `pending.target` current.
    """

    def __init__(
        self,
        *,
        use_ray: bool = True,
        p2p: P2PMode = "auto",
        page_size: int = DEVICE_PAGE_SIZE,
        prefix: str = DEFAULT_PREFIX,
    ) -> None:
        super().__init__(use_ray=use_ray, p2p=p2p, page_size=page_size, prefix=prefix)
        self.layout: Layout | None = None
        self.pending: ScalePlan | None = None
        self.model_dir = ""
        self.model_config: ModelConfig | None = None
        self.dtype = torch.bfloat16
        self.bytes_read_from_disk = 0
        self.esft_slots = (0, 0)  # (N adapter slots, E_max rows each) per expert stack
        self.adapters: dict[str, EsftEntry] = {}
        self._sources: dict[tuple[str, int], tuple[str, ...]] | None = None

    # ---- devices the layout uses (the workers themselves: `DeviceWorkers`) -------------

    def remove_device(self, device_id: int) -> None:
        """Unregister a device the committed layout does not use (its node is drained or given
        back; `DeviceWorkers.remove_device`)."""
        if device_id in self.devices and (
            self.pending is not None or (self.layout is not None and device_id in self.layout.device_ids)
        ):
            raise RuntimeError(f"hmm: device {device_id} holds (or is about to hold) the model; scale off it first")
        super().remove_device(device_id)

    def forget_devices(self, device_ids: Sequence[int]) -> None:
        """Unregister devices that are gone with their memory (their node died): no call reaches
        them. A committed layout that used them keeps them as *lost* until the next plan, which
        neither reads nor frees them (`lost_device_ids`); a pending plan is aborted first."""
        gone = [d for d in device_ids if d in self.devices]
        if not gone:
            return
        if self.pending is not None and set(gone) & set(self.pending.device_ids()):
            p, self.pending = self.pending, None
            alive = [d for d in p.device_ids() if d not in gone]
            try:
                self._all(alive, "abort")
            except Exception:  # noqa: BLE001 - a survivor that cannot abort is freed at its restore
                logger.exception("hmm: aborting the pending plan without devices %s", gone)
        super().forget_devices(gone)

    @property
    def lost_device_ids(self) -> frozenset[int]:
        """Devices of the committed layout that are no longer registered (lost with their node)."""
        return frozenset(self.layout.device_ids) - set(self.devices) if self.layout is not None else frozenset()

    def restore_device(self, device_id: int) -> dict[str, int]:
        """Replace the worker of `device_id` (dead, or to be replaced) with a new one and refill
        its share of the committed layout (`restore_plan`: replicated tensors by p2p from a live
        replica, its experts from disk, an empty KV pool, its ESFT adapter rows from their files).
        The new worker frees what the dead one left in /dev/shm (`lease.reap`); an instance still
        mapping that memory keeps it until it retires. A pending plan is aborted first. Returns
        bytes by source (`bytes_disk`, `bytes_p2p_*`)."""
        if device_id not in self.devices:
            raise ValueError(f"hmm: device {device_id} is not registered")
        if self.pending is not None:
            try:
                self.abort()
            except Exception:  # noqa: BLE001 - the dead worker cannot abort; the others did
                logger.exception("hmm: aborting the pending plan before restoring device %d", device_id)
                self.pending = None
        self._replace_worker(device_id)
        layout = self.layout
        if layout is None or device_id not in layout.device_ids:
            return {}
        p = restore_plan(layout, device_id)
        specs = self._specs(layout, device_id)
        rows = [r for entry in self.adapters.values() for r in self._adapter_rows(layout, entry).get(device_id, [])]
        kv, cache = layout.kv_bytes[layout.rank_of(device_id)], layout.cache_bytes_of(device_id)
        staged = self._gather([self._call(device_id, "begin", specs, self.dtype, kv, DEFAULT_OPTIONS, rows, cache,
                                          layout.host_experts)])[0]
        disk = [s.key for s in p.steps if isinstance(s, DiskLoad)]
        expected = {s.key for s in p.steps if isinstance(s, DiskLoad | P2PCopy)}
        try:
            if set(staged) != expected:
                raise InvalidPlan(f"device {device_id}: staged {len(staged)} tensors, the restore fills {len(expected)}")
            read = self._gather([self._call(device_id, "load_from_disk", self.model_dir, _subset(specs, disk),
                                            self.dtype)])[0]
            stats = {"bytes_disk": read, **self._p2p(p)}
            self._gather([self._call(device_id, "commit")])
        except BaseException:
            self._gather([self._call(device_id, "abort")])
            raise
        self.bytes_read_from_disk += read
        logger.info("hmm: device %d restored: %s", device_id, stats)
        return stats

    # ---- load / plan / execute / commit / abort ---------------------------------------

    def load(
        self,
        model_dir: str,
        dp: int,
        dtype: torch.dtype = torch.bfloat16,
        kv_bytes: int | None = None,
        esft_slots: tuple[int, int] = (0, 0),
        replicated: bool = False,
        cache_bytes: int | None = None,
        host_experts: bool = True,
    ) -> dict[str, int]:
        """Initial layout of (dp, ep=dp) on the first `dp` devices (`replicated`: ep=1, every device
        holds every expert): each tensor read from disk once, the replicas filled by p2p; committed
        on success; bytes by source, as `execute` returns them. `cache_bytes` offloads the experts
        (an expert cache of that size per device, the expert rows as host tier, or with
        `host_experts=False` in the checkpoint only: the disk tier; `hmm.layout`).
        `esft_slots` = (N, E_max):
        every expert stack is a virtual weight tensor with N adapter slots of E_max rows
        (address space only). Adapters registered before (an `unload` + `load`) are mapped again."""
        if self.layout is not None:
            raise RuntimeError("hmm: a model is already loaded")
        self.model_dir, self.dtype, self.esft_slots = model_dir, dtype, esft_slots
        self.model_config = cfg = ModelConfig.from_pretrained(model_dir)
        sizes = ModelSizes.from_model(cfg, dtype.itemsize)
        layout = layout_for(None, sizes, list(self.devices.values()), dp, 1 if replicated else dp, kv_bytes=kv_bytes,
                            cache_bytes=cache_bytes, host_experts=host_experts)
        moved = self.execute(load_plan(layout))
        self.commit()
        for entry in list(self.adapters.values()):
            self._map_adapter(entry)
        return moved

    # ---- ESFT adapters ------------------------------------------------------------------

    def load_adapter(
        self, name: str, slot: int, path: str, experts: dict[int, tuple[int, ...]]
    ) -> dict[int, dict[str, list[SlotPages]]]:
        """Map and fill adapter `name`'s experts in adapter slot `slot`: each on the device holding
        the base expert it replaces. Returns device -> param -> the new rows' pages (the ranks map
        them into their views). All or nothing."""
        n, e_max = self.esft_slots
        if self.layout is None or self.pending is not None:
            raise RuntimeError("hmm: adapters load with a committed layout and no pending plan")
        if name in self.adapters or not 0 <= slot < n or any(a.slot == slot for a in self.adapters.values()):
            raise ValueError(f"hmm: adapter {name!r} / slot {slot} is taken or out of range [0, {n})")
        if any(len(ids) > e_max for ids in experts.values()):
            raise ValueError(f"hmm: an adapter layer tunes more than E_max={e_max} experts")
        entry = EsftEntry(name, slot, path, dict(experts))
        pages = self._map_adapter(entry)
        self.adapters[name] = entry
        return pages

    def unload_adapter(self, name: str) -> int:
        """Release adapter `name`'s rows on every device (pages back to the pools); bytes freed."""
        entry = self.adapters.pop(name)
        assert self.layout is not None
        rows = self._adapter_rows(self.layout, entry)
        return sum(self._gather([
            self._call(d, "unmap_adapter_rows", [(r.param, r.row) for r in rs]) for d, rs in rows.items()
        ]))

    def adapter_rows(self, name: str) -> dict[int, dict[str, list[int]]]:
        """device -> stacked param -> the rows adapter `name` occupies in the committed layout."""
        assert self.layout is not None
        out: dict[int, dict[str, list[int]]] = {}
        for device, rows in self._adapter_rows(self.layout, self.adapters[name]).items():
            for r in rows:
                out.setdefault(device, {}).setdefault(r.param, []).append(r.row)
        return out

    def _map_adapter(self, entry: EsftEntry) -> dict[int, dict[str, list[SlotPages]]]:
        assert self.layout is not None
        rows = self._adapter_rows(self.layout, entry)
        devices = list(rows)
        results = [self._call(d, "map_adapter_rows", rows[d]) for d in devices]
        try:
            pages = self._gather(results)
        except BaseException:
            # NOTE: a device that failed mapped nothing; undo the ones that succeeded.
            for d in devices:
                try:
                    self._gather([self._call(d, "unmap_adapter_rows", [(r.param, r.row) for r in rows[d]])])
                except Exception:  # noqa: BLE001 - best effort; the original error matters
                    logger.exception("hmm: undoing adapter %r on device %d failed", entry.name, d)
            raise
        return dict(zip(devices, pages, strict=True))

    def _adapter_rows(
        self, layout: Layout, entry: EsftEntry, previous: Layout | None = None
    ) -> dict[int, list[AdapterRow]]:
        """device -> rows of `entry`'s experts in `layout` (with their rows in `previous`, if the
        expert stays on that device)."""
        _, e_max = self.esft_slots
        sources = self._expert_sources()
        rows: dict[int, list[AdapterRow]] = defaultdict(list)
        for layer, ids in entry.experts.items():
            for index, e in enumerate(ids):
                d = layout.holder(e)
                row = len(layout.local_experts(d)) + entry.slot * e_max + index
                old = None
                if previous is not None and d in previous.device_ids and previous.holder(e) == d:
                    old = len(previous.local_experts(d)) + entry.slot * e_max + index
                for param in ("w13", "w2"):
                    name = f"layers.{layer}.moe.{param}"
                    rows[d].append(AdapterRow(name, row, sources[(name, e)], entry.path, old))
        return dict(rows)

    def _expert_sources(self) -> dict[tuple[str, int], tuple[str, ...]]:
        """(stacked param, expert) -> its checkpoint tensor names (the same in adapter files)."""
        if self._sources is None:
            cfg = self.model_config
            assert cfg is not None
            specs = model_family(cfg.arch).param_specs(cfg, tuple(range(cfg.num_experts)))
            self._sources = {
                (s.name, e): src
                for s in specs if s.expert_ids is not None
                for e, src in zip(s.expert_ids, s.sources, strict=True)
            }
        return self._sources

    def plan(self, target: TargetConfig, options: TransitionOptions = DEFAULT_OPTIONS) -> ScalePlan:
        """A plan from the committed layout to `target` using the mechanisms in `options` (lost
        devices are neither read nor freed)."""
        if self.layout is None:
            raise RuntimeError("hmm: nothing loaded")
        return plan(self.layout, target, options, lost=self.lost_device_ids)

    def unload(self) -> None:
        """Abort anything pending and free every device's tensors; keep the workers, their
        page pools and the p2p group, so `load` works again (cold restart)."""
        self.abort()
        self._all(list(self.devices), "clear")
        self.layout = None

    def execute(self, p: ScalePlan) -> dict[str, int]:
        """Run `p` up to (not including) its Free steps; on any error, `abort()` and re-raise.
        Returns bytes by source: `bytes_disk`, `bytes_local_copy`, `bytes_p2p_fast`, `bytes_p2p_gloo`."""
        if self.pending is not None:
            raise RuntimeError("hmm: another plan is pending; commit or abort it first")
        if p.current is not self.layout and p.current != self.layout:
            raise InvalidPlan("hmm: the plan does not start from the current layout")
        self.pending = p
        try:
            stats = self._stage_and_load(p)
            stats.update(self._p2p(p))
            return stats
        except BaseException:
            logger.exception("hmm: execute failed; rolling back")
            self.abort()
            raise

    def _specs(self, layout: Layout, device_id: int) -> list[ParamSpec]:
        assert self.model_config is not None
        n, e_max = self.esft_slots
        specs = model_family(self.model_config.arch).param_specs(self.model_config, layout.local_experts(device_id))
        return with_adapter_slots(specs, n * e_max)

    def _stage_and_load(self, p: ScalePlan) -> dict[str, int]:
        tgt, ids = p.target, p.device_ids()
        specs = {d: self._specs(tgt, d) if d in tgt.device_ids else [] for d in ids}
        kv = {d: tgt.kv_bytes[tgt.rank_of(d)] if d in tgt.device_ids else 0 for d in ids}
        # ESFT adapters move with their base experts (pages kept where the expert stays).
        rows: dict[int, list[AdapterRow]] = defaultdict(list)
        for entry in self.adapters.values():
            for d, rs in self._adapter_rows(tgt, entry, p.current).items():
                rows[d] += rs
        filled = self._gather(
            [self._call(d, "begin", specs[d], self.dtype, kv[d], p.options, rows.get(d, []), tgt.cache_bytes_of(d),
                        tgt.host_experts)
             for d in ids]
        )
        expected: dict[int, set[TensorKey]] = defaultdict(set)
        disk: dict[int, list[TensorKey]] = defaultdict(list)
        local: dict[int, list[TensorKey]] = defaultdict(list)
        for s in p.steps:
            if isinstance(s, P2PCopy | DiskLoad | LocalCopy):
                expected[s.dst_device if isinstance(s, P2PCopy) else s.device].add(s.key)
            if isinstance(s, DiskLoad):
                disk[s.device].append(s.key)
            if isinstance(s, LocalCopy):
                local[s.device].append(s.key)
        for d, keys in zip(ids, filled, strict=True):
            if set(keys) != expected[d]:
                raise InvalidPlan(
                    f"device {d}: staged {len(keys)} new tensors, the plan fills {len(expected[d])}"
                )
        # One batch: devices work concurrently; a Ray actor runs its own calls in order.
        loads = [
            self._call(d, "load_from_disk", self.model_dir, _subset(specs[d], keys), self.dtype)
            for d, keys in disk.items()
        ]
        copies = [self._call(d, "local_copy", keys) for d, keys in local.items()]
        done = self._gather([*loads, *copies])
        read = sum(done[: len(loads)])
        self.bytes_read_from_disk += read
        return {"bytes_disk": read, "bytes_local_copy": sum(done[len(loads) :])}

    def _p2p(self, p: ScalePlan) -> dict[str, int]:
        copies = [s for s in p.steps if isinstance(s, P2PCopy)]
        if not copies:
            return {"bytes_p2p_fast": 0, "bytes_p2p_gloo": 0}
        node = {d: s.node_id for d, s in self.devices.items()}
        fast = [c for c in copies if self._is_fast(node[c.src_device], node[c.dst_device])]
        gloo = [c for c in copies if c not in fast]
        by_dst: dict[int, list[P2PCopy]] = defaultdict(list)
        for c in fast:
            by_dst[c.dst_device].append(c)
        jobs = []
        for dst, cs in by_dst.items():
            by_src: dict[int, list[P2PCopy]] = defaultdict(list)
            for c in cs:
                by_src[c.src_device].append(c)
            srcs = list(by_src)
            found = self._gather([self._call(s, "source_handles", [c.key for c in by_src[s]]) for s in srcs])
            items = [
                HandleCopy(c.key, h, slot)
                for s, hs in zip(srcs, found, strict=True)
                for c, (h, slot) in zip(by_src[s], hs, strict=True)
            ]
            jobs.append(self._call(dst, "copy_from_handles", items))
        moved_fast = sum(self._gather(jobs))
        transfers: dict[int, list[Transfer]] = defaultdict(list)
        for tag, c in enumerate(gloo):
            transfers[c.src_device].append(Transfer("send", self._rank(c.dst_device), tag, c.key))
            transfers[c.dst_device].append(Transfer("recv", self._rank(c.src_device), tag, c.key))
        results = self._gather([self._call(d, "run_transfers", trs) for d, trs in transfers.items()])
        return {"bytes_p2p_fast": moved_fast, "bytes_p2p_gloo": sum(results) // 2}

    def _is_fast(self, src_node: int, dst_node: int) -> bool:
        return self.p2p == "fast" or (self.p2p == "auto" and src_node == dst_node) or not self.use_ray

    def commit(self) -> int:
        """Free what the pending target does not hold (its Free steps) and make it current.
        Returns the bytes freed.

        # NOTE: call only once no instance reads the old layout's expert pages.
        """
        if self.pending is None:
            raise RuntimeError("hmm: nothing to commit")
        p = self.pending
        freed = sum(self._all(p.device_ids(), "commit"))
        planned = sum(s.nbytes for s in p.steps if isinstance(s, Free))
        logger.info("hmm: committed; freed %d bytes (plan: %d)", freed, planned)
        self.layout, self.pending = p.target, None
        return freed

    def abort(self) -> None:
        """Release everything the pending plan allocated; the old layout stays current."""
        p, self.pending = self.pending, None
        if p is not None:
            self._all(p.device_ids(), "abort")

    # ---- handles and accounting ------------------------------------------------------

    def layout_of(self, pending: bool = False) -> Layout:
        """The committed layout, or (`pending=True`) the target of the executed, uncommitted plan."""
        if pending:
            if self.pending is None:
                raise RuntimeError("hmm: no plan is pending (execute one first)")
            return self.pending.target
        if self.layout is None:
            raise RuntimeError("hmm: nothing loaded")
        return self.layout

    def layout_placement(self) -> ExpertPlacement:
        """Expert placement of the committed layout (what the serving instance uses)."""
        return self.layout_of().placement

    def pending_placement(self) -> ExpertPlacement:
        """Expert placement of the pending target (what the next instance attaches with)."""
        return self.layout_of(pending=True).placement

    def handle_set(self, rank: int, pending: bool = False) -> dict[str, Handle]:
        """{engine param name: handle} + `"kv_pool"` for DP rank `rank` of the committed layout,
        or (`pending=True`) of the pending target, staged by `execute` and valid until `abort`.

        Between `execute` and `commit` both sets are valid at once: the old instance keeps
        serving on the committed handles while the next one attaches to the pending ones.
        On a kept device the two sets share the reused tensors and the KV pool (same pages).
        # NOTE: the shared KV pool must have one allocating owner at a time (see
        # `imm.kv_fence`); `commit` only after the old instance stopped reading its handles.
        """
        layout = self.layout_of(pending)
        return self._gather([self._call(layout.device_ids[rank], "export_handles", pending)])[0]

    def usage(self) -> dict[int, MemoryUsage]:
        ids = list(self.devices)
        return dict(zip(ids, self._all(ids, "usage"), strict=True))

    def host_usage(self) -> dict[int, MemoryUsage]:
        """Per device, the host tier's bytes (offloaded expert stacks)."""
        ids = list(self.devices)
        return dict(zip(ids, self._all(ids, "host_usage"), strict=True))

    def reset_peak(self) -> None:
        self._all(list(self.devices), "reset_peak")

    def shutdown(self) -> None:
        """Abort anything pending, free all device memory, stop the workers. A dead worker does
        not stop the others' shutdown (its files are reaped: `reap`, `lease.reap`)."""
        try:
            self.abort()
        except Exception:  # noqa: BLE001 - a dead worker cannot abort; free what the others hold
            logger.exception("hmm: abort at shutdown failed")
        super().shutdown()
        self.layout = None


def _subset(specs: Sequence[ParamSpec], keys: Sequence[TensorKey]) -> list[ParamSpec]:
    """The specs restricted to `keys`: whole dense tensors, and stacked specs cut to the named experts."""
    by_name = {s.name: s for s in specs}
    out = [by_name[k.name] for k in keys if k.kind == "dense"]
    experts: dict[str, list[int]] = defaultdict(list)
    for k in keys:
        if k.kind == "expert":
            experts[k.name].append(k.expert_id)
    for name, ids in experts.items():
        spec = by_name[name]
        assert spec.expert_ids is not None
        rows = [spec.expert_ids.index(e) for e in ids]
        out.append(
            replace(
                spec,
                shape=(len(rows), *spec.shape[1:]),
                sources=tuple(spec.sources[i] for i in rows),
                expert_ids=tuple(ids),
            )
        )
    return out


HMMControllerActor = ray.remote(num_cpus=0)(HMMController)
