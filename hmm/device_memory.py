"""`DeviceMemory`: every tensor one device holds, in shareable device memory.

Non-expert tensors are shm tensors keyed by engine param name; each stacked
expert param (`layers.{i}.moe.w13` / `.w2`) is a `VirtualTensor` over the
device's `PagePool`, one page-aligned slot per local expert in placement order;
the KV pool is one `uint8` shm tensor that instances view with their KV shape.
Everything is charged to one `MemoryAccount` (current + peak bytes), except under expert
offloading: then the expert stacks are the host tier, pages of a second pool charged to a host
account, and the device holds an expert cache pool (a `uint8` shm tensor, new for every staged
state: one instance's private rows) beside its dense tensors and KV pool.

Transitions are two-phase. `begin(specs, ...)` builds a *staged* state next to
the current one: tensors the target keeps are the same objects (same shm
names), kept experts map the SAME physical pages at their target slots
(zero-copy, any slot order), and only what is new gets fresh memory, returned
as the keys to fill (by `load_from_disk`, p2p or `local_copy`). `TransitionOptions`
turn reuse off for baselines: without `zero_copy` every target tensor (and the
KV pool) gets fresh memory; without `paged_remap` an expert stack whose expert
list changes is allocated anew, all its experts to fill. Invariant: old mappings stay
valid until `commit` — nothing of the current state is unmapped or freed before
it. `commit` frees what the target does not hold and makes it current; `abort`
releases everything `begin` allocated, leaving the current state and the
account's `used` exactly as before.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from elasticmoe.models.weights import ParamSpec, SafetensorsWeightProvider
from hmm.layout import EXPERT_CACHE, KV_POOL, TensorKey
from hmm.memory import (
    MemoryAccount,
    MemoryUsage,
    PagePool,
    ShmBackend,
    TensorHandle,
    VirtualTensor,
    VirtualTensorHandle,
)
from hmm.memory.page_table import SlotPages
from hmm.memory.segments import DEFAULT_PREFIX
from hmm.transition_options import DEFAULT_OPTIONS, TransitionOptions

logger = logging.getLogger(__name__)

DEVICE_PAGE_SIZE = 64 * 1024
Handle = TensorHandle | VirtualTensorHandle


@dataclass(slots=True)
class ExpertStack:
    """One stacked expert param: `vt.tensor[slot]` holds global expert `expert_ids[slot]`."""

    vt: VirtualTensor
    expert_ids: tuple[int, ...]
    layer: int

    def slot(self, expert: int) -> int:
        return self.expert_ids.index(expert)


@dataclass(frozen=True, slots=True)
class AdapterRow:
    """One ESFT adapter expert in a device's expert stack `param` (ExpertWeave's virtual weight
    tensor: base experts first, then N adapter slots of E_max rows)."""

    param: str
    row: int
    sources: tuple[str, ...]  # checkpoint tensor names (the base's), concatenated along dim 0
    adapter_dir: str
    old_row: int | None = None  # in a transition: its row in this device's current stack


@dataclass(slots=True)
class DeviceState:
    """The tensors of one layout on this device (current or staged)."""

    dense: dict[str, torch.Tensor] = field(default_factory=dict)
    experts: dict[str, ExpertStack] = field(default_factory=dict)
    kv: torch.Tensor | None = None
    cache: torch.Tensor | None = None  # the expert cache pool (offloading)

    def tensor(self, key: TensorKey) -> torch.Tensor | None:
        if key.kind == "dense":
            return self.dense.get(key.name)
        if key.kind == "kv":
            return self.kv
        if key.kind == "cache":
            return self.cache
        stack = self.experts.get(key.name)
        if stack is None or key.expert_id not in stack.expert_ids:
            return None
        return stack.vt.tensor[stack.slot(key.expert_id)]


def host_memory_bytes() -> int:
    """This machine's physical memory: the bound of a device's host tier."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


class DeviceMemory:
    """One device's tensors (see the module docstring). Not thread-safe: one caller."""

    def __init__(
        self,
        device_id: int,
        budget_bytes: int,
        page_size: int = DEVICE_PAGE_SIZE,
        prefix: str = DEFAULT_PREFIX,
    ) -> None:
        self.device_id = device_id
        self.account = MemoryAccount(device_id, budget_bytes)
        self.shm = ShmBackend(self.account, prefix)
        self.pool = PagePool(self.account, page_size, prefix=prefix)
        self.prefix = prefix
        self.host_account = MemoryAccount(f"{device_id}-host", host_memory_bytes())
        self.host_pool: PagePool | None = None  # the host tier's pages, made on first use
        self.current = DeviceState()
        self.staged: DeviceState | None = None
        self._readers: dict[str, SafetensorsWeightProvider] = {}

    # ---- transitions -----------------------------------------------------------------

    def begin(
        self,
        specs: Sequence[ParamSpec],
        dtype: torch.dtype,
        kv_bytes: int,
        options: TransitionOptions = DEFAULT_OPTIONS,
        adapter_rows: Sequence[AdapterRow] = (),
        cache_bytes: int = 0,
        host_experts: bool = True,
    ) -> list[TensorKey]:
        """Stage the target tensors `specs` (+ a KV pool of `kv_bytes`) under `options`;
        return the keys that got fresh memory and must be filled (a fresh KV pool is
        never listed: it starts empty). `cache_bytes > 0` offloads the experts: their stacks are
        host tier (with `host_experts=False` the disk tier: the stacks are address space with no
        expert row mapped), and a new, empty expert cache pool of that size is staged. ESFT `adapter_rows` of the target are staged and
        filled here: an expert this device already holds keeps its pages (zero-copy, when
        `options` allow), the others are read from their adapter's files. On error nothing
        is left staged."""
        if self.staged is not None:
            raise RuntimeError(f"device {self.device_id}: a transition is already staged")
        self.staged = staged = DeviceState()
        to_fill: list[TensorKey] = []
        try:
            for spec in specs:
                if spec.is_stacked:
                    to_fill += self._stage_experts(staged, spec, dtype, options, self._expert_pool(cache_bytes > 0),
                                                   with_rows=host_experts or cache_bytes == 0)
                    continue
                cur = self.current.dense.get(spec.name) if options.zero_copy else None
                if cur is not None and tuple(cur.shape) == spec.shape and cur.dtype == dtype:
                    staged.dense[spec.name] = cur  # zero-copy reuse: same shm file
                else:
                    staged.dense[spec.name] = self.shm.allocate(spec.shape, dtype)
                    to_fill.append(TensorKey.dense(spec.name))
            cur_kv = self.current.kv if options.zero_copy else None
            if cur_kv is not None and cur_kv.numel() == kv_bytes:
                staged.kv = cur_kv
            elif kv_bytes > 0:
                staged.kv = self.shm.allocate((kv_bytes,), torch.uint8)
            if cache_bytes > 0:
                staged.cache = self.shm.allocate((cache_bytes,), torch.uint8)
            self._stage_adapter_rows(staged, adapter_rows, options)
        except BaseException:
            self.abort()
            raise
        return to_fill

    def _expert_pool(self, host: bool) -> PagePool:
        """Where expert stacks take their pages: the device, or (offloading) the host tier."""
        if not host:
            return self.pool
        if self.host_pool is None:
            self.host_pool = PagePool(self.host_account, self.pool.page_size, prefix=self.prefix)
        return self.host_pool

    def _stage_experts(
        self, staged: DeviceState, spec: ParamSpec, dtype: torch.dtype, options: TransitionOptions, pool: PagePool,
        with_rows: bool = True,
    ) -> list[TensorKey]:
        """Stage `spec`'s virtual expert tensor; `with_rows=False` (the disk tier) maps none of its
        expert rows (the engines read them from the checkpoint)."""
        assert spec.expert_ids is not None
        ids, row_shape = spec.expert_ids, spec.shape[1:]
        cur = self.current.experts.get(spec.name) if options.zero_copy else None
        num_slots = spec.shape[0]  # > len(ids): ESFT adapter rows after the base experts
        same_geometry = (cur is not None and cur.vt.slot_shape == row_shape and cur.vt.dtype == dtype
                         and cur.vt.pool is pool)
        if cur is not None and same_geometry and cur.expert_ids == ids and cur.vt.num_slots == num_slots:
            staged.experts[spec.name] = cur  # nothing moves: the same virtual tensor
            return []
        if not options.paged_remap:
            cur = None  # no page sharing: a new stack; kept experts are copied in (`local_copy`)
        layer = TensorKey.dense(spec.name).layer
        if layer is None:
            raise ValueError(f"{spec.name}: stacked expert params are named layers.<i>.*")
        vt = VirtualTensor(pool, num_slots, row_shape, dtype, align_slots=True)
        staged.experts[spec.name] = ExpertStack(vt, ids, layer)  # registered first: abort unmaps it
        to_fill: list[TensorKey] = []
        for slot, e in enumerate(ids if with_rows else ()):
            if cur is not None and same_geometry and e in cur.expert_ids:
                vt.map_slot(slot, source=cur.vt.slot_pages(cur.slot(e)))  # same pages, new slot
            else:
                vt.map_slot(slot)
                to_fill.append(TensorKey.expert_row(spec.name, layer, e))
        return to_fill

    def _stage_adapter_rows(
        self, staged: DeviceState, rows: Sequence[AdapterRow], options: TransitionOptions
    ) -> None:
        for r in rows:
            stack = staged.experts[r.param]
            cur = self.current.experts.get(r.param)
            if stack is cur:
                continue  # the same virtual tensor: its adapter rows are already in place
            if r.old_row is not None and cur is not None and options.zero_copy and options.paged_remap:
                stack.vt.map_slot(r.row, source=cur.vt.slot_pages(r.old_row))  # same pages, new row
            else:
                stack.vt.map_slot(r.row)
                self._reader(r.adapter_dir).read_into(stack.vt.tensor[r.row], r.sources)

    def map_adapter_rows(self, rows: Sequence[AdapterRow]) -> dict[str, list[SlotPages]]:
        """Outside a transition: map fresh pages for ESFT adapter rows of the current stacks and
        read them from the adapter's files. Returns param -> the rows' pages (for the ranks'
        views). All or nothing."""
        if self.staged is not None:
            raise RuntimeError(f"device {self.device_id}: adapters change outside transitions only")
        done: list[AdapterRow] = []
        try:
            for r in rows:
                vt = self.current.experts[r.param].vt
                if vt.is_mapped(r.row):
                    raise ValueError(f"device {self.device_id}: {r.param} row {r.row} is already mapped")
                vt.map_slot(r.row)
                done.append(r)
                self._reader(r.adapter_dir).read_into(vt.tensor[r.row], r.sources)
        except BaseException:
            self.unmap_adapter_rows([(r.param, r.row) for r in done])
            raise
        out: dict[str, list[SlotPages]] = {}
        for r in rows:
            out.setdefault(r.param, []).append(self.current.experts[r.param].vt.slot_pages(r.row))
        return out

    def unmap_adapter_rows(self, rows: Sequence[tuple[str, int]]) -> int:
        """Release ESFT adapter rows of the current stacks (pages back to the pool); returns bytes freed."""
        before = self.account.used
        for param, row in rows:
            vt = self.current.experts[param].vt
            if vt.is_mapped(row):
                vt.unmap_slot(row)
        return before - self.account.used

    def _reader(self, path: str | Path) -> SafetensorsWeightProvider:
        reader = self._readers.get(str(path))
        if reader is None:
            reader = self._readers[str(path)] = SafetensorsWeightProvider(path)
        return reader

    def commit(self) -> int:
        """Free what the staged state does not hold and make it current; return bytes freed.

        # NOTE: instances still mapping the old tensors must be retired before this:
        # freed pool pages are hole-punched and read as zeros afterwards.
        """
        if self.staged is None:
            raise RuntimeError(f"device {self.device_id}: nothing staged to commit")
        before = self.account.used
        self._release(self.current, keep=self.staged)
        self.current, self.staged = self.staged, None
        return before - self.account.used

    def abort(self) -> None:
        """Release everything `begin` allocated; the current state is untouched."""
        if self.staged is not None:
            staged, self.staged = self.staged, None
            self._release(staged, keep=self.current)

    def _release(self, state: DeviceState, keep: DeviceState) -> None:
        kept = {id(t) for t in keep.dense.values()} | {id(s) for s in keep.experts.values()}
        # NOTE: unmap expert stacks first: a page shared with `keep` only drops one
        # reference, so the pages `keep` maps are never released here.
        for stack in state.experts.values():
            if id(stack) not in kept:
                stack.vt.close()
        for t in state.dense.values():
            if id(t) not in kept:
                self.shm.free(t)
        if state.kv is not None and state.kv is not keep.kv:
            self.shm.free(state.kv)
        if state.cache is not None and state.cache is not keep.cache:
            self.shm.free(state.cache)

    # ---- filling and reading ---------------------------------------------------------

    def local_copy(self, keys: Iterable[TensorKey]) -> int:
        """Copy each key's current buffer into its own, different staged buffer (a
        device-internal memcpy for kept tensors that got new memory); return the bytes."""
        if self.staged is None:
            raise RuntimeError(f"device {self.device_id}: nothing staged to copy into")
        copied = 0
        for key in keys:
            src, dst = self.current.tensor(key), self.staged.tensor(key)
            if src is None or dst is None:
                raise KeyError(
                    f"device {self.device_id}: local copy of {key} needs a current and a staged buffer"
                )
            if dst.data_ptr() == src.data_ptr():
                raise ValueError(f"device {self.device_id}: {key} is reused in place; nothing to copy")
            dst.copy_(src)
            copied += dst.numel() * dst.element_size()
        return copied

    def writable(self, key: TensorKey) -> torch.Tensor:
        """The staged buffer of `key` (the current one when nothing is staged)."""
        t = (self.staged or self.current).tensor(key)
        if t is None:
            raise KeyError(f"device {self.device_id}: no buffer for {key}")
        return t

    def readable(self, key: TensorKey) -> torch.Tensor:
        """A filled buffer of `key`: the current one, else the staged one (initial load)."""
        for state in (self.current, self.staged):
            t = state.tensor(key) if state is not None else None
            if t is not None:
                return t
        raise KeyError(f"device {self.device_id}: does not hold {key}")

    def load_from_disk(self, model_dir: str | Path, specs: Iterable[ParamSpec], dtype: torch.dtype) -> int:
        """Read exactly the checkpoint tensors of `specs` (stacked specs may name any
        subset of the staged experts) into their buffers; return the bytes read."""
        reader = self._reader(model_dir)
        start = reader.bytes_read
        for spec in specs:
            if spec.expert_ids is None:
                rows = [(self.writable(TensorKey.dense(spec.name)), spec.sources[0])]
            else:
                layer = TensorKey.dense(spec.name).layer
                assert layer is not None
                keys = [TensorKey.expert_row(spec.name, layer, e) for e in spec.expert_ids]
                rows = [(self.writable(k), src) for k, src in zip(keys, spec.sources, strict=True)]
            for dst, names in rows:
                reader.read_into(dst, names)
        return reader.bytes_read - start

    # ---- handles and accounting ------------------------------------------------------

    def export_handles(self, staged: bool = False) -> dict[str, Handle]:
        """{engine param name: handle} plus `"kv_pool"` (and `"expert_cache"` when offloading), for
        the current (or staged) state."""
        state = self.staged if staged else self.current
        if state is None:
            raise RuntimeError(f"device {self.device_id}: nothing staged")
        out: dict[str, Handle] = {n: self.shm.export(t) for n, t in state.dense.items()}
        out.update({n: s.vt.export() for n, s in state.experts.items()})
        if state.kv is not None:
            out[KV_POOL] = self.shm.export(state.kv)
        if state.cache is not None:
            out[EXPERT_CACHE] = self.shm.export(state.cache)
        return out

    def source_handle(self, key: TensorKey) -> tuple[Handle, int | None]:
        """Handle of a filled buffer of `key` (+ the expert's slot) for the same-node fast path."""
        for state in (self.current, self.staged):
            if state is None or state.tensor(key) is None:
                continue
            if key.kind == "expert":
                stack = state.experts[key.name]
                return stack.vt.export(), stack.slot(key.expert_id)
            return self.shm.export(self.readable(key)), None
        raise KeyError(f"device {self.device_id}: does not hold {key}")

    def usage(self) -> MemoryUsage:
        return self.account.usage()

    def host_usage(self) -> MemoryUsage:
        """The host tier's bytes (expert stacks of an offloading layout)."""
        return self.host_account.usage()

    def free(self, names: Iterable[str] = ()) -> None:
        """Free current dense tensors by name (outside a transition)."""
        if self.staged is not None:
            raise RuntimeError(f"device {self.device_id}: free during a staged transition")
        for name in names:
            self.shm.free(self.current.dense.pop(name))

    def clear(self) -> None:
        """Free every tensor (staged and current); the page pool stays usable, so a
        later `begin` loads a model again (the cold-restart baseline)."""
        self.abort()
        self._release(self.current, keep=DeviceState())
        self.current = DeviceState()
        self._readers.clear()

    def close(self) -> None:
        """Free everything (staged and current) and the page pool."""
        self.clear()
        self.pool.close()
        if self.host_pool is not None:
            self.host_pool.close()
