"""Which LoRA slot each waiting request gets, and which adapters to swap into the hot set.

The engine's LoRA policy between steps (MoLoRA §5.2 hot set, CoServe §4.2-4.3): a request
whose adapters are resident gets their slots; the adapters of waiting requests inside the
scheduling window that are only in host memory are copied into a free slot, else in place of
the resident adapter the eviction policy picks (`elasticmoe.adapter_policy.eviction`;
`EngineConfig.adapter_eviction`):

- **coserve** (default): two-stage over the dependency graph of the loaded adapters and learned
  routers (router -> each adapter it routes to). Stage 1, adapters stranded behind a predecessor
  that is not resident; stage 2, by the probability that the next request needs the adapter:
  its usage probability from the profile, else declared at load, else its observed request rate
  (an EMA) as a fallback, plus that of the routers that route to it (their requests need all of
  their adapters resident);
- **lru**, **fifo**: the Samba-CoE baselines.

Whatever the policy: an adapter a running request uses, one that became resident in this pass,
one the request being served needs beside the incoming adapter (a per-token table or router
mixes them), or one an older request in the window waits for is never evicted; adapters any
other waiting request needs go last (the scheduler starts ready requests from anywhere in the
queue, so evicting a resident adapter with queued requests would send them back to wait).
Copies run on a background thread where the engine allows it; the waiting requests get their
slots once the copy is done.

With the coserve policy, when no swap is under way and no request of the window waits for an
adapter (demand first), `preload` also restores CoServe's initial order (§4.1) one adapter at a
time: the most probable adapter out of the slots replaces a strictly less probable one that no
request needs and that served none since its load (or any idle one, if the candidate is likelier
than all other adapters out of the slots together; `adapter_policy.preload`), so an adapter
registered while the slots were full does not wait for its first requests to come in. Under EP
the swaps are the lockstep loop's, the same on every rank (`engine.lora_lockstep`).

NOTE: in this engine routers live beside the model, always resident, so no LoRA adapter is ever
stranded and stage 1 picks nothing; it acts where a predecessor can leave the tier (see
`adapter_policy.graph`).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Collection, Iterable, Mapping
from typing import Any

import torch

from elasticmoe.adapter_policy.eviction import Residency, TierView, eviction_policy, select_victims
from elasticmoe.adapter_policy.graph import DependencyGraph, Node
from elasticmoe.adapter_policy.preload import preload_choice
from elasticmoe.adapter_policy.usage import (
    RateEstimator,
    check_probability,
    needed_probability,
    usage_probabilities,
)
from elasticmoe.adapters.lora_slots import LoraSlots
from elasticmoe.engine.request import Request
from elasticmoe.engine.scheduler import Scheduler

logger = logging.getLogger(__name__)


def router_node(name: str) -> str:
    """The graph node (and usage key) of learned router `name`: routers and adapters have separate
    namespaces, so a router's node is prefixed."""
    return f"router:{name}"


def copier_has_a_core() -> bool:
    """Whether this process has a core for a background slot copy beside its compute threads and one
    more (the server's other processes). On 2 vCPUs with one compute thread per rank it has not:
    there a write of the small model's 24 MB slot on the step thread (0.65 ms per swap) cost the
    other requests less than the copy thread did (CoServe bench, 16 req/s: requests resident on
    arrival 0.90x and 1.03x of the all-resident run, against 1.34x and 1.16x; docs/adapters.md)."""
    return len(os.sched_getaffinity(0)) >= torch.get_num_threads() + 2


class LoraSwapper:
    def __init__(self, lora: LoraSlots, scheduler: Scheduler, can_swap_async: bool, eviction: str = "coserve",
                 routers: Callable[[], Mapping[str, Any]] = dict, profiled: Mapping[str, float] | None = None,
                 lockstep: bool = False, unloading: Callable[[], Collection[str]] = frozenset) -> None:
        """`routers()`: the loaded learned routers by name (each with `.adapters`); `profiled`: usage
        probabilities from an offline profile, by adapter name (routers: `router_node(name)`).
        `lockstep`: the engine is one rank of an EP group, whose swaps the lockstep loop makes at
        round boundaries for every rank alike (`engine.lora_lockstep`); this swapper only assigns.
        `unloading()`: adapters on their way out (never preloaded)."""
        self.lora = lora
        self.scheduler = scheduler
        self.can_swap_async = can_swap_async
        self.lockstep = lockstep
        # Copy adapters into slots on a background thread (when it can) where the copy gets a core
        # of its own; else on the step thread (`copier_has_a_core`).
        self.async_swaps = copier_has_a_core()
        self.policy = eviction_policy(eviction)
        self.preloads = eviction == "coserve"  # CoServe §4.1; the baselines only swap on demand
        self.routers = routers
        self.profiled = {n: check_probability(p, f"profile usage_probability of {n!r}")
                         for n, p in (profiled or {}).items()}
        self.declared: dict[str, float] = {}  # usage_probability given at load, by usage key
        self.rates = RateEstimator()  # the observed fallback, by usage key
        self._arrivals: dict[str, int] = {}  # usage key -> requests since the last swap pass
        self._seq = 0  # one counter orders loads and uses (FIFO / LRU)
        self._loaded_seq: dict[str, int] = {}
        self._used_seq: dict[str, int] = {}
        self.unloading = unloading
        self._preload_order: list[str] | None = None  # pre-assessed usage keys, most probable first
        self.registry_version = 0  # declarations and forgets so far (EP ranks compare it before a preload)
        self._no_preload: tuple[Any, ...] | None = None  # the situation the last `preload` declined
        self._finished_early: set[str] = set()  # copies `preload` found complete, for the next pass
        self._copy_failed: set[str] = set()  # adapters whose last copy into a slot raised
        # The dependency graph of the loaded adapters and routers, and what it was built from: built
        # again only when those change (`_graph`), not for every eviction decision.
        self._graph_of: tuple[Any, DependencyGraph] | None = None

    # ---- what the adapter manager tells it -----------------------------------------------------

    def note_arrival(self, key: str) -> None:
        """A request arrived for `key`: an adapter, `router_node(router)`, or each adapter of a
        per-token table."""
        self._arrivals[key] = self._arrivals.get(key, 0) + 1

    def declare(self, key: str, probability: float | None) -> None:
        """The usage probability declared at load (None: none declared)."""
        if probability is None:
            self.declared.pop(key, None)
        else:
            self.declared[key] = check_probability(probability)
        self._preload_order = None
        self.registry_version += 1

    def forget(self, key: str) -> None:
        """`key` was unloaded: drop what was known about it."""
        for table in (self.declared, self._arrivals, self._loaded_seq, self._used_seq):
            table.pop(key, None)
        self.rates.forget(key)
        self._copy_failed.discard(key)
        self._preload_order = None
        self.registry_version += 1

    # ---- around a step -------------------------------------------------------------------------

    def assign(self, request: Request) -> None:
        """Give a request its slot(s) if its adapters are resident now, else make it wait.
        A per-token request gets each range's slot, once all of them are resident."""
        lora, binding = self.lora, request.binding
        if binding.routing is not None:
            slots = [-1 if n is None else lora.index(n) for n in binding.routing.adapters]
            if any(s is None for s in slots):
                binding.wait()
            else:
                binding.per_token(torch.tensor(slots, dtype=torch.long))
                for name in sorted(n for n in binding.routing.adapters if n is not None):
                    self._mark_used(name)
            return
        assert binding.name is not None
        slot = lora.index(binding.name)
        if slot is None:
            binding.wait()
        else:
            binding.resident(slot)
            # NOTE: used from the moment a request holds its slot, not only once a pass sees it
            # running: a request may start and finish between two passes, and `preload` treats an
            # adapter that served nothing since its load as free to displace.
            self._mark_used(binding.name)

    def swap_in(self) -> list[tuple[Request, BaseException]]:
        """One pass between steps: assign arrived adapters, start the swaps the window needs.
        Returns the waiting requests whose adapter's copy failed, with the error: the engine fails
        them alone; the adapter stays in host memory (a later request tries it again)."""
        lora = self.lora
        self.rates.update(self._arrivals)
        self._arrivals = {}
        arrived = set(self._collect_copies()) | self._finished_early  # completed since the last step
        self._finished_early = set()
        copy_errors = lora.take_failed_swaps()
        self._copy_failed.update(copy_errors)  # not preloaded again until a request's swap succeeds
        failed: list[tuple[Request, BaseException]] = []
        for r in self.scheduler.waiting if copy_errors else ():
            broken = sorted(copy_errors.keys() & r.binding.lora_names)
            if r.binding.is_waiting and broken:
                failed.append((r, copy_errors[broken[0]]))
        self._start_swaps(arrived, {id(r) for r, _ in failed})
        return failed

    def _start_swaps(self, arrived: set[str], failing: set[int]) -> None:
        """The pass's work after the copies were collected: `failing` (request ids) are about to
        be failed, so they start no swap."""
        lora = self.lora
        self._note_residents()
        running = self.scheduler.running
        for r in running:
            for name in sorted(r.binding.lora_names):
                self._mark_used(name)
        waiting = self.scheduler.waiting
        # Swap in only for the scheduling window (the requests admission looks at next, CoServe §4.2).
        window = self.scheduler.window_requests()
        in_window = {id(r) for r in window}
        pending: dict[str, list[Request]] = {}  # non-resident adapter -> waiting requests needing it
        for r in waiting:
            if r.binding.is_waiting and id(r) not in failing:
                # NOTE: a window request is assigned again whatever made its adapters resident: one
                # left waiting for a resident adapter would wait forever (no pass copies it in).
                if arrived & r.binding.lora_names or id(r) in in_window:
                    self.assign(r)
                    if not r.binding.is_waiting:
                        continue
                if id(r) not in in_window:
                    continue
                for name in sorted(r.binding.lora_names):
                    if lora.index(name) is None and not lora.is_filling(name):
                        pending.setdefault(name, []).append(r)
        if not pending or self.lockstep:
            return
        # NOTE: adapters that just became resident are not evicted before their requests ran once
        # (else a one-slot hot set would swap them out again at once, forever).
        busy = set().union(arrived, *(r.binding.lora_names for r in running))
        queued: set[str] | None = None  # every adapter a waiting request needs: only for an eviction
        first_need: dict[str, int] = {}  # adapter -> queue position of the first window request needing it
        for i, r in enumerate(window):
            for n in r.binding.lora_names:
                first_need.setdefault(n, i)
        for name, requests in pending.items():  # the adapter of the longest-waiting request first
            free = lora.free_slots()
            if free:
                slot = free[0]
            else:
                together = set().union(*(r.binding.lora_names for r in requests))  # resident beside `name`
                # NOTE: an adapter an older request waits for is not evicted for a younger one's (else
                # a window with more adapters than slots swaps its adapters out and back, forever).
                ahead = {n for n, i in first_need.items() if i < first_need[name]}
                # NOTE: an adapter with requests queued anywhere goes last, not only one the window's
                # younger requests need: the scheduler starts ready requests from anywhere in the queue,
                # and evicting their adapter while another victim exists sends them back to wait for
                # the window to reach them.
                if queued is None:
                    queued = set().union(*(r.binding.lora_names for r in waiting))
                victim = self._victim(busy | together | ahead, queued - {name})
                if victim is None:
                    return  # every slot serves running or older requests: wait for one to finish
                slot = lora.evict(victim)
                self._loaded_seq.pop(victim, None)
                for r in waiting:
                    if victim in r.binding.lora_names:
                        r.binding.wait()
            busy.add(name)  # not evicted again in this pass
            if self.can_swap_async and self.async_swaps:
                lora.swap_in_async(name, slot)  # its requests wait until `finish_swaps` reports it
                continue
            self._copy_now(name, slot)

    # ---- preloading (CoServe §4.1 while the server runs) ----------------------------------------

    def preload(self) -> str | None:
        """With one rank, nothing being copied in and no request of the scheduling window waiting for
        an adapter: start copying the most probable adapter out of the slots into a free slot, or in
        place of a strictly less probable one that no live or waiting request needs
        (`adapter_policy.preload`). Returns the adapter, or None.

        Runs between steps and after a load. Cheap when it declines again for the same reason: the
        full decision (usage probabilities over every loaded adapter, ~0.5 ms at 1,000) is made
        only when the slots, the candidate, the adapters requests need or the declarations have
        changed."""
        lora = self.lora
        if not self.preloads or self.lockstep:
            return None
        # NOTE: an idle engine makes no pass to collect finished copies, and one copy at a time
        # would leave a registration burst's preloads waiting for the first request; their waiting
        # requests (none, usually) get their slots at the next pass, before the next step.
        self._finished_early.update(self._collect_copies())
        if lora.filling:
            return None
        # NOTE: demand first. While a window request waits for an adapter out of the slots, the next
        # pass copies it in; a preload now would take a slot that demand then takes back. Under a
        # backlog over many adapters the likeliest adapter went back and forth, a preload and an
        # eviction per cold request (the lockstep plan proposes only with an empty window too).
        if any(r.binding.is_waiting for r in self.scheduler.window_requests()):
            return None
        best = self.preload_candidate()
        if best is None:
            return None
        free = lora.free_slots()
        if free:  # nothing to weigh: a demand swap would have taken it this pass if one needed it
            name, slot = best, free[0]
        else:
            # NOTE: walks the queue (the swap pass does too); only with the slots full.
            pinned = set().union(*(r.binding.lora_names for r in self.scheduler.running))
            queued = set().union(*(r.binding.lora_names for r in self.scheduler.waiting))
            evictable = frozenset(lora.slot_of.keys() - pinned - queued)
            situation = (best, tuple(sorted(lora.slot_of.items())), evictable, self.registry_version)
            if not evictable or situation == self._no_preload:
                return None
            choice = self.preload_decision(best, self._residency(), pinned, queued)
            if choice is None or choice[1] is None:
                self._no_preload = situation
                return None
            name, displaced = choice[0], choice[1]
            slot = lora.evict(displaced)
            self._loaded_seq.pop(displaced, None)
        lora.num_preloads += 1
        if self.can_swap_async and self.async_swaps:
            lora.swap_in_async(name, slot)  # resident once `finish_swaps` reports it
        else:
            self._copy_now(name, slot)
        return name

    def _copy_now(self, name: str, slot: int) -> None:
        """Copy `name` into `slot` on this thread and give its waiting requests their slots. A copy
        that raises is a failed swap as a background one's is (`LoraSlots.failed_swaps`): the slot
        stays free, and the next pass fails the requests that waited for the adapter, not the step."""
        try:
            self.lora.swap_in(name, slot)
        except Exception as exc:  # noqa: BLE001 - the waiting requests fail, never the engine
            logger.error("lora: copying adapter %r into slot %d failed: %r", name, slot, exc)
            self.lora.failed_swaps[name] = exc
            return
        self._mark_loaded(name)
        self._assign_waiting_for(name)

    def _assign_waiting_for(self, name: str) -> None:
        """`name` was just copied in on this thread: every waiting request that needs it gets its
        slots now, not only those of the window it was copied for. A request behind the window
        whose adapter a swap evicted waits for it (`binding.wait`), and one that found its adapter
        resident when it reached the window would never be assigned: no pass copies a resident
        adapter, and only a background copy's arrival re-assigns the queue (`swap_in`)."""
        for r in self.scheduler.waiting:
            if r.binding.is_waiting and name in r.binding.lora_names:
                self.assign(r)

    def preload_candidate(self) -> str | None:
        """The loaded adapter with the highest pre-assessed usage probability, above 0 (profile,
        else declared; ties: the first name) that is out of the slots, not being copied in and not
        being unloaded, nor one whose last copy failed (a request's swap tries it again)."""
        if self._preload_order is None:
            known = {**self.declared, **self.profiled}
            self._preload_order = sorted((n for n in known if known[n] > 0), key=lambda n: (-known[n], n))
        lora, unloading = self.lora, self.unloading()
        for name in self._preload_order:
            if lora.is_loaded(name) and lora.index(name) is None and not lora.is_filling(name) \
                    and name not in unloading and name not in self._copy_failed and name not in lora.failed_swaps:
                return name
        return None

    def preload_decision(self, best: str, resident: Mapping[str, Residency], pinned: Collection[str],
                         queued: Collection[str]) -> tuple[str, str | None] | None:
        """`preload_choice` for candidate `best` against the `resident` adapters (with their
        residency in the caller's clock), from pre-assessed probabilities only: no observed rate, so
        EP ranks deciding from the same inputs decide alike. The graph holds the residents, `best`
        and the routers, which is every node whose needed probability the choice reads (a LoRA
        adapter's predecessors are routers); the other adapters out of the slots count only as
        their summed probability."""
        lora = self.lora
        routers = {router_node(k): r for k, r in self.routers().items()}
        names = [*resident, best]
        present = set(names)
        graph = DependencyGraph.build([Node(n, "lora", 1) for n in names] + [Node(k, "router", 0) for k in routers],
                                      [(k, a) for k, r in routers.items() for a in r.adapters if a in present])
        usage = usage_probabilities([*lora.names, *routers], self.profiled, self.declared, {})
        view = TierView(graph, {**resident, **dict.fromkeys(routers, Residency(0, 0))},
                        needed_probability(graph, usage), frozenset(present & set(pinned)),
                        frozenset(present & set(queued)))
        outside = sum(usage[n] for n in lora.names if n not in present)
        return preload_choice(self.policy, view, [best], len(lora.free_slots()), outside)

    # ---- the eviction decision -----------------------------------------------------------------

    def tier_view(self, pinned: Iterable[str] = (), queued: Iterable[str] = (),
                  residency: dict[str, Residency] | None = None, observed_rates: bool = True) -> TierView:
        """The LoRA slots as the eviction policies see them: every loaded adapter a node of one
        slot, every learned router a resident node (it lives beside the model) with edges to its
        adapters; the needed probability of each (see the module docstring).
        `residency` (default: this swapper's clock) and `observed_rates=False` (profiled and
        declared probabilities only) are for a plan that every EP rank must make alike."""
        resident = self._residency() if residency is None else dict(residency)
        routers = {router_node(k): r for k, r in self.routers().items()}
        graph = self._graph(routers)
        resident.update(dict.fromkeys(routers, Residency(0, 0)))
        usage = usage_probabilities(graph.nodes, self.profiled, self.declared,
                                    self.rates.rates(graph.nodes) if observed_rates else {})
        return TierView(graph, resident, needed_probability(graph, usage),
                        frozenset(n for n in pinned if n in graph), frozenset(n for n in queued if n in graph))

    def _graph(self, routers: Mapping[str, Any]) -> DependencyGraph:
        """Every loaded adapter a node of one slot, every learned router (`routers`, by node name) a
        resident node with edges to its loaded adapters. Kept until the adapters or the routers
        change: building it over 1,000 adapters took ~3 ms of the step thread, at every eviction."""
        lora = self.lora
        key = (tuple(lora.names), tuple((k, tuple(r.adapters)) for k, r in routers.items()))
        if self._graph_of is None or self._graph_of[0] != key:
            nodes = [Node(n, "lora", 1) for n in lora.names] + [Node(k, "router", 0) for k in routers]
            edges = [(k, a) for k, r in routers.items() for a in r.adapters if lora.is_loaded(a)]
            self._graph_of = (key, DependencyGraph.build(nodes, edges))
        return self._graph_of[1]

    def _victim(self, pinned: set[str], queued: set[str]) -> str | None:
        victims = select_victims(self.policy, self.tier_view(pinned, queued), need=1)
        return victims[0] if victims else None

    def _residency(self) -> dict[str, Residency]:
        """Each resident adapter's load and last use, in this swapper's clock."""
        self._note_residents()
        return {n: Residency(self._loaded_seq[n], max(self._loaded_seq[n], self._used_seq.get(n, 0)))
                for n in self.lora.slot_of}

    def _collect_copies(self) -> list[str]:
        """The background copies that completed since the last collection: resident now, loaded
        as of now."""
        finished = self.lora.finish_swaps()
        for name in sorted(finished):
            self._mark_loaded(name)
        return finished

    def _tick(self) -> int:
        self._seq += 1
        return self._seq

    def _mark_loaded(self, name: str) -> None:
        self._loaded_seq[name] = self._used_seq[name] = self._tick()
        self._copy_failed.discard(name)

    def _mark_used(self, name: str) -> None:
        if name not in self._loaded_seq:
            self._note_residents()  # a resident since its registration: loaded before this use
        self._used_seq[name] = self._tick()

    def _note_residents(self) -> None:
        """Adapters that became resident without a swap (loaded into a free slot at registration)
        count as loaded now, in slot order."""
        lora = self.lora
        for name in sorted((n for n in lora.slot_of if n not in self._loaded_seq), key=lora.slot_of.__getitem__):
            self._mark_loaded(name)
