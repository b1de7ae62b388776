"""`LoraSlots`: the LoRA adapters one engine serves: S fixed device slots (MoLoRA's hot set,
§5.2) in front of a host-memory cache of every loaded adapter.

Loading an adapter reads its factors into host memory (scaling folded in) and, if a slot
is free, into that slot. A request for an adapter that is not resident waits (its
requests are passed over by the scheduler, not waited on) until the engine swaps it in
on a background thread (its requests keep waiting; the forward goes on beside the copy, which
writes a slot no scheduled token reads): into a free slot, else in place of the resident
adapter the eviction policy picks (`elasticmoe.engine.lora_swapper`, CoServe §4.3), never one
with running requests.

Sites (see `elasticmoe.layers.lora`), for the modules the slots hold (`target_modules`, default
all): per GQA attention layer a fused q|k|v site (the targeted ones among the three at rank
offsets 0, R, 2R and their own output rows) and an o site; per MLA attention
layer (DeepSeek-V2) a fused site of the two projections of the hidden state (of those targeted,
q_proj or q_a_proj first, then kv_a_proj_with_mqa), a q_b site (with q_lora_rank) and an o
site (kv_b_proj is rejected: `elasticmoe.adapters.lora.KV_B_PROJ_UNSUPPORTED`); per MoE layer
an `ExpertLora` with a gate|up site and a down site keyed `slot * E_local + local expert`.
All are allocated once, at engine start, so their addresses never change and (under EP)
every rank exchanges the same tensors in every step. Under EP a rank holds the factors of
its own experts only: an adapter's expert LoRA follows its expert's device, and a new
instance after a scale loads them for its own placement.

Per-request routing: a request's tokens carry its slot; every site adds its delta for the
whole mixed batch in one grouped computation. Not thread-safe: the engine's thread calls it.
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait

import torch
import torch.nn.functional as F

from elasticmoe.adapters.lora import KV_B_PROJ_UNSUPPORTED
from elasticmoe.adapters.lora_targets import (
    EXPERT_PARTS,
    check_served,
    holds_expert_modules,
    parse_target_modules,
)
from elasticmoe.errors import AdapterConflictError, AdapterError, AdapterLimitError
from elasticmoe.layers.experts import expert_rows_linear, grouped_experts_at_slot_rows, grouped_experts_sorted
from elasticmoe.layers.lora import LoraGroups, LoraSite
from elasticmoe.models.common import CausalLM, GQAAttention, MoEBlock
from elasticmoe.models.deepseek_v2 import MLAttention
from elasticmoe.parallel.expert_placement import ExpertPlacement

logger = logging.getLogger(__name__)

_ATTN = re.compile(r"^model\.layers\.(\d+)\.self_attn\.(\w+)$")
_EXPERT = re.compile(r"^model\.layers\.(\d+)\.(?:mlp|block_sparse_moe)\.experts\.(\d+)\.(\w+)$")

# weights(module path, dtype) -> (A [r, in], B [out, r]) of one targeted module
LoraWeights = Callable[[str, torch.dtype], tuple[torch.Tensor, torch.Tensor]]
# attention module name (q_proj, ...) -> (its site, output row offset, rank offset in the site)
AttentionSites = dict[str, tuple[LoraSite, int, int]]


def attention_sites(attn: object, num_slots: int, max_rank: int, dtype: torch.dtype,
                    targets: frozenset[str] | None = None) -> AttentionSites:
    """Give one attention layer its LoRA sites (fixed from now on) and say where each module goes.
    `targets`: the module names slots hold (None: all). A fused site holds only the targeted modules
    of its input, at rank offsets 0, R, ... in the order below (its output rows stay the whole
    projection's)."""
    def fused(modules: tuple[tuple[str, int], ...]) -> list[tuple[str, int]]:
        return [(name, row0) for name, row0 in modules if targets is None or name in targets]

    sites: AttentionSites = {}

    def site(entries: list[tuple[str, int]], hidden: int, out: int) -> LoraSite | None:
        """One site for `entries` (module, output row offset), recorded in `sites`; None without any."""
        if not entries:
            return None
        lora = LoraSite(num_slots, len(entries) * max_rank, hidden, out, dtype)
        sites.update({name: (lora, row0, i * max_rank) for i, (name, row0) in enumerate(entries)})
        return lora

    if isinstance(attn, GQAAttention):
        q, kv = attn.num_heads * attn.head_dim, attn.num_kv_heads * attn.head_dim
        hidden = attn.qkv.shape[1]
        attn.lora_qkv = site(fused((("q_proj", 0), ("k_proj", q), ("v_proj", q + kv))), hidden, q + 2 * kv)
        attn.lora_o = site(fused((("o_proj", 0),)), q, hidden)
    elif isinstance(attn, MLAttention):
        first, name = (attn.q_a, "q_a_proj") if attn.q_lora else (attn.q, "q_proj")  # [out, hidden]
        (q_out, hidden), kv_out = first.shape, attn.kv_a.shape[0]
        attn.lora_x = site(fused(((name, 0), ("kv_a_proj_with_mqa", q_out))), hidden, q_out + kv_out)
        attn.lora_o = site(fused((("o_proj", 0),)), attn.o.shape[1], hidden)
        if attn.q_lora:
            attn.lora_q_b = site(fused((("q_b_proj", 0),)), attn.q_b.shape[1], attn.q_b.shape[0])
    return sites


class ExpertLora:
    """LoRA sites of one MoE layer's experts (see the module docstring)."""

    def __init__(self, num_slots: int, num_local: int, max_rank: int, hidden: int, inter: int,
                 dtype: torch.dtype, top_k: int = 1) -> None:
        self.num_local, self.inter, self.max_rank, self.top_k = num_local, inter, max_rank, top_k
        self.w13 = LoraSite(num_slots * num_local, 2 * max_rank, hidden, 2 * inter, dtype)
        self.w2 = LoraSite(num_slots * num_local, max_rank, inter, hidden, dtype)

    def experts(self, xs: torch.Tensor, slots: torch.Tensor, lora_slots: torch.Tensor,
                w13: torch.Tensor, w2: torch.Tensor, slot_rows: torch.Tensor | None = None) -> torch.Tensor:
        """The grouped experts of rows sorted by expert slot, plus the weighted LoRA of each row's
        adapters (`lora_slots`: per row its K slots, then their K weights, as floats). `slot_rows`
        [num_local]: where each local expert's weights sit in `w13`/`w2` (an expert cache's pool
        rows, when the experts are offloaded); the LoRA factors stay indexed by the expert."""
        k = lora_slots.shape[1] // 2
        adapter, weights = lora_slots[:, :k].long(), lora_slots[:, k:]
        local = slots.unsqueeze(1)
        has = (adapter >= 0) & (local < self.num_local)  # ESFT adapter rows never carry a LoRA
        groups = LoraGroups.build(torch.where(has, adapter * self.num_local + local, -1), weights)
        if groups is None:
            if slot_rows is not None:
                return grouped_experts_at_slot_rows(xs, slots, slot_rows, w13, w2)
            return grouped_experts_sorted(xs, slots, w13, w2, self.num_local)
        gate_up = groups.add_delta(expert_rows_linear(xs, slots, w13, self.num_local, slot_rows), xs, self.w13.a,
                                   self.w13.bt)
        gate, up = gate_up.chunk(2, dim=-1)
        h = F.silu(gate) * up
        return groups.add_delta(expert_rows_linear(h, slots, w2, self.num_local, slot_rows), h, self.w2.a, self.w2.bt)


class LoraSlots:
    def __init__(self, model: CausalLM, placement: ExpertPlacement, rank: int, max_loras: int, max_rank: int,
                 dtype: torch.dtype, max_cached: int | None = None, top_k: int = 1,
                 target_modules: tuple[str, ...] | None = None) -> None:
        """`target_modules`: the module names the slots hold (None: every module this model can serve).
        A slot costs only their sites: on the small Qwen3-MoE at rank 8 in float32, 24.3 MB with every
        module (the experts' sites are 95% of it), 0.66 MB with q_proj and v_proj."""
        if max_loras < 1 or max_rank < 1:
            raise ValueError(f"lora: need max_loras >= 1 and max_lora_rank >= 1, got {max_loras}, {max_rank}")
        check_served(parse_target_modules(target_modules), model.cfg)
        self.placement, self.rank, self.max_loras, self.max_rank = placement, rank, max_loras, max_rank
        self.target_modules = target_modules
        targets = None if target_modules is None else frozenset(target_modules)
        self.attention: dict[int, AttentionSites] = {}  # layer -> its attention's modules
        self.experts: dict[int, ExpertLora] = {}
        num_local = len(placement.local_expert_ids(rank))
        with_experts = holds_expert_modules(targets)
        # Under EP a slot's expert factors serve every rank's tokens, so its ranks must swap it
        # together; attention sites serve only this rank's own tokens (the same on every rank: the
        # targets and layers are the deployment's, whatever experts this rank holds).
        self.spans_ranks = with_experts and any(isinstance(layer.mlp, MoEBlock) for layer in model.layers)
        for i, layer in enumerate(model.layers):
            sites = attention_sites(layer.attn, max_loras, max_rank, dtype, targets)
            if sites:
                self.attention[i] = sites
            if isinstance(layer.mlp, MoEBlock) and num_local and with_experts:
                block = layer.mlp
                inter, hidden = block.w2.shape[2], block.w2.shape[1]
                block.lora = self.experts[i] = ExpertLora(max_loras, num_local, max_rank, hidden, inter, dtype,
                                                          top_k)
        self.max_cached = max_cached if max_cached is not None else max_loras
        if self.max_cached < max_loras:
            raise ValueError(f"lora: max_cached ({self.max_cached}) must be >= max_loras ({max_loras})")
        self.host: dict[str, dict[str, tuple[torch.Tensor, torch.Tensor]]] = {}  # name -> path -> (A, sB)
        self.slot_of: dict[str, int] = {}  # resident adapters
        self.num_swaps_in = self.num_evictions = self.num_hits = self.num_misses = 0
        self.num_preloads = 0  # swaps in made ahead of any request (counted in num_swaps_in too)
        self.swap_s = 0.0  # time spent copying factors into slots (CoServe Fig. 15: expert management)
        self.filling: dict[int, tuple[str, Future[None]]] = {}  # slot -> adapter copied in the background
        self.failed_swaps: dict[str, BaseException] = {}  # background copies that raised, until taken
        self._copier: ThreadPoolExecutor | None = None
        # What one slot's factors take, every site's share of it (the sites never change)
        every_site = [*self._attention_sites(), *(s for lora in self.experts.values() for s in (lora.w13, lora.w2))]
        self.slot_bytes = sum(s.a.nbytes + s.bt.nbytes for s in every_site) // max_loras
        logger.info("lora: %d slots of %.2f MB each (%s), rank up to %d", max_loras, self.slot_bytes / 1e6,
                    ",".join(target_modules) if target_modules else "every module", max_rank)

    @property
    def names(self) -> list[str]:
        """Every loaded adapter (resident or in host memory), in load order."""
        return list(self.host)

    def index(self, name: str) -> int | None:
        """The adapter's slot if it is resident."""
        return self.slot_of.get(name)

    def is_loaded(self, name: str) -> bool:
        return name in self.host

    def check_fits(self, name: str, modules: dict[str, tuple[int, int, int]]) -> None:
        """Raise unless an adapter with these modules (path -> (r, in, out)) can be loaded now."""
        if name in self.host:
            raise AdapterConflictError(f"adapter {name!r} is already loaded")
        # NOTE: what this server can never serve first; the host budget only says "not now"
        for path, (r, _, _) in modules.items():
            self._site(path)  # raises for modules this model, or these slots, cannot serve
            if r > self.max_rank:
                raise AdapterLimitError(f"{path} has rank {r}; slots hold at most {self.max_rank} (--max-lora-rank)")
        if len(self.host) >= self.max_cached:  # the host budget: a 400 naming the field (CoServe issue, item 7)
            raise AdapterError("name", f"registering it would exceed the host budget: all {self.max_cached} LoRA "
                               f"adapters the host cache holds are registered (--max-cpu-loras; {self.max_loras} "
                               f"LoRA slots, --max-loras); unload one first")

    def _site(self, path: str) -> tuple[LoraSite, int, int, int | None]:
        """(site, output row offset, rank offset, global expert or None) of a module path."""
        module = path.rsplit(".", 1)[-1]
        if self.target_modules is not None and module not in self.target_modules:
            raise AdapterError("target_modules", f"{path}: this server's LoRA slots hold only "
                               f"{','.join(self.target_modules)} (--lora-target-modules)")
        m = _ATTN.match(path)
        if m is not None:
            sites = self.attention.get(int(m.group(1)), {})
            if m.group(2) in sites:
                site, row0, rank0 = sites[m.group(2)]
                return site, row0, rank0, None
            if m.group(2) == "kv_b_proj" and "kv_a_proj_with_mqa" in sites:
                raise AdapterError("target_modules", f"{path}: {KV_B_PROJ_UNSUPPORTED}")
            raise ValueError(f"target_modules: {path}: not a LoRA target of this model's attention")
        m = _EXPERT.match(path)
        if m is not None and m.group(3) in EXPERT_PARTS and int(m.group(1)) in self.experts:
            lora, part = self.experts[int(m.group(1))], EXPERT_PARTS[m.group(3)]
            expert = int(m.group(2))
            if part == "down":
                return lora.w2, 0, 0, expert
            return lora.w13, (0 if part == "gate" else lora.inter), (0 if part == "gate" else self.max_rank), expert
        raise ValueError(f"target_modules: {path}: not a LoRA target of this model")

    def load(self, name: str, modules: dict[str, tuple[int, int, int]], weights: LoraWeights, scaling: float,
             slot: int | None = None) -> int | None:
        """Read adapter `name`'s factors (this rank's share) into host memory and, if a slot is free
        (or `slot` is given), into a slot. Returns the slot, or None if it waits in host memory."""
        self.check_fits(name, modules)
        factors: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        for path in modules:
            site, _, _, expert = self._site(path)
            if expert is not None and self.placement.expert_to_rank[expert] != self.rank:
                continue  # its expert's rank holds it
            a, b = weights(path, site.a.dtype)
            factors[path] = (a.clone(), (b * scaling).to(site.bt.dtype))
        self.host[name] = factors
        free = self.free_slots()
        if slot is not None:
            if slot not in free:
                del self.host[name]
                raise AdapterConflictError(f"LoRA slot {slot} is in use or outside [0, {self.max_loras})")
        elif free:
            slot = free[0]
        if slot is not None:
            self.swap_in(name, slot)
        logger.info("lora: adapter %r loaded (%d modules), %s", name, len(modules),
                    f"slot {slot}" if slot is not None else "in host memory")
        return slot

    def free_slots(self) -> list[int]:
        return sorted(set(range(self.max_loras)) - set(self.slot_of.values()) - set(self.filling))

    def swap_in(self, name: str, slot: int) -> None:
        """Write a loaded adapter's factors into a free slot (now, on the caller's thread). If the
        copy raises, the slot stays free and is cleared (a half-written slot must not serve the next
        adapter's tokens), and the error propagates."""
        try:
            self._write(name, slot)
        except BaseException:
            self._clear(slot)
            raise
        self.slot_of[name] = slot
        self.num_swaps_in += 1

    def swap_in_async(self, name: str, slot: int) -> None:
        """Start copying `name` into the free `slot` on a background thread; `finish_swaps` makes it
        resident once done. Safe beside the forward: no scheduled token uses a filling slot."""
        if self._copier is None:
            self._copier = ThreadPoolExecutor(1, thread_name_prefix="lora-swap")
        self.filling[slot] = (name, self._copier.submit(self._write, name, slot))

    def is_filling(self, name: str) -> bool:
        return any(n == name for n, _ in self.filling.values())

    def wait_for_a_swap(self) -> None:
        """Block until one background copy is done (the engine has nothing else to run)."""
        if self.filling:
            wait([f for _, f in self.filling.values()], return_when=FIRST_COMPLETED)

    def finish_swaps(self, block: bool = False) -> list[str]:
        """Adapters whose background copy completed (now resident); `block`: wait for every copy.
        A copy that raised leaves its adapter in host memory and its slot free, and is kept in
        `failed_swaps` for the swapper to fail the requests that waited for it."""
        done = []
        for slot, (name, future) in list(self.filling.items()):
            if block or future.done():
                del self.filling[slot]
                exc = future.exception()
                if exc is not None:
                    logger.error("lora: copying adapter %r into slot %d failed: %r", name, slot, exc)
                    self.failed_swaps[name] = exc
                    self._clear(slot)  # NOTE: a half-written slot must not serve the next adapter's tokens
                    continue
                self.slot_of[name] = slot
                self.num_swaps_in += 1
                done.append(name)
        return done

    def take_failed_swaps(self) -> dict[str, BaseException]:
        """The background copies that failed since the last call, by adapter."""
        failed, self.failed_swaps = self.failed_swaps, {}
        return failed

    def _write(self, name: str, slot: int) -> None:
        start = time.perf_counter()
        self._clear(slot)
        local = len(self.placement.local_expert_ids(self.rank))
        for path, (a, b) in self.host[name].items():
            site, row0, rank0, expert = self._site(path)
            key = slot if expert is None else slot * local + self.placement.expert_to_slot[expert]
            site.write(key, a, b, row0, rank0)
        self.swap_s += time.perf_counter() - start  # NOTE: a float add; a background copy races only with readers

    def evict(self, name: str) -> int:
        """Free the adapter's slot (it stays loaded in host memory); returns the slot.
        NOTE: not zeroed here: no token reads a free slot, and every write into one clears it first
        (`_write`). Zeroing the small model's 24 MB slot took ~1.4 ms of the step thread per swap."""
        slot = self.slot_of.pop(name)
        self.num_evictions += 1
        return slot

    def unload(self, name: str) -> None:
        for slot, (n, future) in list(self.filling.items()):
            if n == name:
                future.result()
                del self.filling[slot]
                self._clear(slot)
        if name in self.slot_of:
            self._clear(self.slot_of.pop(name))
        self.host.pop(name)

    def occupancy(self) -> dict[str, int]:
        """The slots: how many, what each takes, how many hold an adapter; the adapters loaded."""
        return {"slots": self.max_loras, "slot_bytes": self.slot_bytes, "resident": len(self.slot_of),
                "loaded": len(self.host)}

    def _attention_sites(self) -> list[LoraSite]:
        """Each attention site once (a fused site serves several modules)."""
        return list({id(site): site for sites in self.attention.values() for site, _, _ in sites.values()}.values())

    def _clear(self, slot: int) -> None:
        for site in self._attention_sites():
            site.clear(slot)
        for lora in self.experts.values():
            lora.w13.clear(slot * lora.num_local, lora.num_local)
            lora.w2.clear(slot * lora.num_local, lora.num_local)
