"""`ClusterManager`: the devices, the HMM and the active instance behind one coordinator.

It lives in the coordinator's Serve replica (one replica) and owns every actor it starts:
the HMM device workers and the instances' ranks. What the ingress routes by is published
through `feed` (`coordinator.routing_state`): every change of the active instance, of the
switchover gate, of the adapters accepting requests and of health is a new `RoutingState`.

Lifecycle: `start()` (blocking: devices -> HMM load of (dp, ep=dp), while the first standby
instance boots beside them -> attach -> warm-up -> published -> activate), then serving, then
`shutdown()` (idempotent: nothing published to route to, instance retired, HMM memory freed and
workers stopped).

Pre-initialisation (paper §4.5): with `config.standby_pool`, after the start and
after every scale a background thread boots standby instances (processes up,
EP group formed, skeleton built, no weights) for dp-1 and dp+1 of the active
instance into the `InstanceManager`'s LRU pool; the scaler takes its target
from there. The processes of retired ranks are kept (`config.idle_rank_processes`) and become
ranks of the next instances on their nodes (`imm.rank_processes`). A failing `start()` shuts down
what it started before re-raising, so no actor or /dev/shm file outlives it.

The nodes and devices it runs on (registered as nodes join; removed as they are drained, given
back or lost) are the `NodePool` it extends (`coordinator.node_pool`).

The blocking methods use `ray.get`; asyncio callers run them in a thread.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import ray

from coordinator.active import ActiveInstance
from coordinator.adapters import ClusterAdapterHost
from coordinator.config import CoordinatorConfig
from coordinator.memory_stats import AdapterSlotStats, DeviceMemoryStats, layout_memory
from coordinator.node_pool import NodePool
from coordinator.routing_state import Health, RoutingFeed, RoutingState
from coordinator.scale_events import ScaleEvents
from elasticmoe.config import ModelConfig
from hmm.controller import HMMController
from hmm.layout import DeviceSpec, ModelSizes
from hmm.memory.lease import reap
from imm.instance import Instance, seeds_from_hmm
from imm.lifecycle import InstanceState
from imm.manager import InstanceManager
from imm.rank_processes import RankProcessPool
from imm.rank_stats import RankStats

logger = logging.getLogger(__name__)


class ClusterManager(NodePool):
    """Owns the HMM and the active `Instance` on its `NodePool`; publishes what the ingress routes by (`feed`)."""

    def __init__(self, config: CoordinatorConfig) -> None:
        self.config = config
        super().__init__()
        self.feed = RoutingFeed()
        self._active: ActiveInstance | None = None
        self._withdrawn = False  # no instance can serve: nothing is published to route to (`withdraw`)
        self._health = Health()
        self._publish_lock = threading.Lock()  # one author at a time: states are built from these fields
        self.scale_events = ScaleEvents()
        self.hmm: HMMController | None = None
        self.standby = InstanceManager(self._boot_standby, capacity=2)
        self.processes = RankProcessPool(config.idle_rank_processes)  # retired ranks' processes, reused
        self.adapters = ClusterAdapterHost(self, publish=self.publish_adapters)
        self._starting: Instance | None = None  # the first instance until it is published
        self._standby_thread: threading.Thread | None = None
        self._standby_superseded = threading.Event()  # set: the delayed preparation under way is dropped
        self._closing = threading.Event()  # ends a delayed standby preparation at shutdown
        self._is_shut_down = False
        self._lock = threading.Lock()

    # ---- lifecycle -----------------------------------------------------------------------

    def start(self) -> None:
        """Bring up devices, load the model at `config.dp` and activate an instance on it."""
        cfg = self.config
        boot: Future[Instance] | None = None
        try:
            self.hmm = HMMController(use_ray=True, prefix=cfg.shm_prefix)
            offered = self._offered_devices()
            with ThreadPoolExecutor(1, thread_name_prefix="start-boot") as pool:  # its exit waits for the boot
                if cfg.backend == "native":
                    # NOTE: the ranks boot (processes, torch import, EP group, skeletons) while the device
                    # workers start and the model loads (`HMMController.load`: on the first dp devices
                    # registered); a vLLM rank builds its engine on the loaded replica (`seeds_from_hmm`).
                    boot = pool.submit(self.create_instance, cfg.dp, offered[: cfg.dp])
                self._register_offered(offered)
                self.load_model(cfg.dp)
            assert self.hmm.layout is not None
            devices = self.hmm.layout.devices
            inst = self._starting = boot.result() if boot else self.create_instance(cfg.dp, devices)
            if inst.nodes != self.rank_nodes(devices):  # the ranks map their devices' memory: same nodes
                raise RuntimeError(f"coordinator: ranks booted on {inst.nodes}, the model loaded on {devices}")
            inst.attach(self.hmm)
            inst.warm_up()
            self.publish(inst, min(ray.get([r.max_model_len.remote() for r in inst.ranks])))
            self.release_requests()
            inst.activate()
            logger.info("coordinator: %s active on %d devices of %d nodes (timings %s)", inst, len(self.hmm.devices),
                        len({s.ray_node_id for s in self.hmm.devices.values()}), inst.timings)
            self.prepare_standby()
            self._start_node_watch()
        except BaseException:
            logger.exception("coordinator: start failed; releasing what was started")
            if boot is not None and boot.exception() is None and self._starting is None:
                self._starting = boot.result()  # the load failed: the ranks booted beside it retire too
            self.shutdown()
            raise

    def load_model(self, dp: int) -> dict[str, int]:
        """Load the model into the HMM at `dp` (each tensor from disk once): experts spread over the
        ranks (native), or a full replica per device (vLLM, `CoordinatorConfig.is_expert_parallel`).
        Returns the bytes moved by source (`HMMController.execute`)."""
        cfg, hmm = self.config, self.hmm
        assert hmm is not None
        model = ModelConfig.from_pretrained(cfg.model_dir)
        cache = cfg.hmm_cache_bytes(ModelSizes.from_model(model, cfg.torch_dtype.itemsize), model.top_k)
        return hmm.load(cfg.model_dir, dp=dp, dtype=cfg.torch_dtype, kv_bytes=cfg.hmm_kv_bytes, esft_slots=cfg.esft_slots,
                        replicated=not cfg.is_expert_parallel, cache_bytes=cache,
                        host_experts=cfg.expert_tier == "host")

    def create_instance(self, dp: int, devices: Sequence[DeviceSpec], paced: bool = False) -> Instance:
        """A standby instance of `dp` (the configured backend) whose rank r runs on the node of
        `devices[r]`; vLLM ranks build their engines on a committed replica's handles where one is on
        their node (`seeds_from_hmm`). `paced`: see `Instance.create_standby`."""
        cfg, hmm = self.config, self.hmm
        seeds = seeds_from_hmm(hmm, devices) if cfg.backend == "vllm" and hmm is not None and hmm.layout else []
        return Instance.create_standby(cfg.model_dir, dp, engine_options=cfg.engine_options(), paced=paced,
                                       nodes=self.rank_nodes(devices), seeds=seeds, backend=cfg.backend,
                                       processes=self.processes)

    def _boot_standby(self, dp: int) -> Instance:
        """A standby instance for the scale to `dp` the current layout leads to, its ranks on the
        nodes of that scale's devices (the pool's factory: paced, beside serving)."""
        return self.create_instance(dp, self.target(dp).devices, paced=True)

    # ---- what is active and what the ingress routes by: published here only ------------------

    @property
    def active(self) -> Instance | None:
        """The instance published last (None before the first, after shutdown)."""
        active = self._active
        return active.instance if active is not None else None

    @property
    def routing(self) -> RoutingState:
        """What the ingress routes by now (`feed`'s latest state)."""
        return self.feed.current

    def publish(self, inst: Instance, max_model_len: int) -> None:
        """Make `inst` (warm, its ranks attached) the one the ingress routes to, in one state; it
        carries the adapters accepting requests. The gate is not opened here (`release_requests`)."""
        with self._publish_lock:
            adapters = self._active.adapters if self._active is not None else ()
            self._active = ActiveInstance(inst, tuple(inst.ranks), tuple(inst.device_ids), max_model_len, adapters)
            self._withdrawn = False
            self._publish()

    def withdraw(self) -> None:
        """No instance can serve and none can be made now (no device left): the dead one is
        retired and nothing is published to route to, so requests get a 503 at once instead of
        waiting; the next `publish` ends this."""
        inst = self.active
        if inst is not None and inst.state is not InstanceState.RETIRED:
            try:
                inst.retire(wait_dead_s=10.0)
            except Exception:  # noqa: BLE001 - its ranks are gone with their node anyway
                logger.exception("coordinator: retiring %s failed", inst)
        with self._publish_lock:
            self._withdrawn = True
            self._publish(is_accepting=True)

    def publish_adapters(self, names: tuple[str, ...]) -> None:
        """The adapters accepting requests changed: a new state of the same instance."""
        with self._publish_lock:
            if self._active is not None:
                self._active = self._active.with_adapters(tuple(names))
            self._publish()

    def publish_health(self, health: Health) -> None:
        """The healer's view changed (what `/ready` and `/health` say)."""
        with self._publish_lock:
            if health == self._health:
                return
            self._health = health
            self._publish()

    def hold_requests(self) -> None:
        """A switchover's critical section starts: new requests wait at the ingress."""
        with self._publish_lock:
            self._publish(is_accepting=False)

    def release_requests(self) -> None:
        """The critical section ended: new requests go to the published instance."""
        with self._publish_lock:
            self._publish(is_accepting=True)

    def _publish(self, **changes: Any) -> None:
        active, health = self._active, self._health
        ranks = active.ranks if active is not None and not self._is_shut_down and not self._withdrawn else ()
        adapters = active.adapters if ranks and active is not None else ()
        registry = self.adapters.adapters
        self.feed.update(
            instance_id=active.instance.instance_id if ranks and active is not None else None,
            ranks=ranks,
            max_model_len=active.max_model_len if ranks and active is not None else 0,
            adapters=adapters,
            adapter_kinds=tuple((n, registry[n].kind) for n in adapters if n in registry),
            swapped_out=tuple(n for n in self.adapters.swapped_out if n in adapters),
            is_serving=bool(ranks) and not health.is_broken,
            faults=health.faults,
            has_given_up=health.has_given_up,
            **changes,
        )

    @property
    def is_shut_down(self) -> bool:
        return self._is_shut_down

    @property
    def is_preparing_standby(self) -> bool:
        return self._standby_thread is not None and self._standby_thread.is_alive()

    def prepare_standby(self, delay_s: float = 0.0) -> None:
        """Boot standby instances for dp-1 and dp+1 of the active one, in the background,
        starting `delay_s` from now (a boot takes CPU from serving when devices are cores)."""
        inst, hmm = self.active, self.hmm
        if not self.config.standby_pool or inst is None or hmm is None or self._is_shut_down:
            return
        dps = [d for d in (inst.dp + 1, inst.dp - 1) if 1 <= d <= len(self.usable_devices())]
        superseded = threading.Event()  # a later preparation replaces this one while it still waits

        def work() -> None:
            if superseded.wait(delay_s) or self._closing.is_set():  # replaced, or shutting down
                return
            try:
                self.standby.prepare(dps)
            except Exception:  # noqa: BLE001 - a missing standby only makes the next scale slower
                logger.exception("coordinator: preparing standby instances %s failed", dps)

        with self._lock:
            previous, cancel = self._standby_thread, self._standby_superseded
            if previous is not None and previous.is_alive():
                cancel.set()  # still waiting out its delay: drop it (its dps were for an older dp)
                previous.join()  # NOTE: one preparation at a time; a boot under way is waited for
            self._standby_superseded = superseded
            self._standby_thread = threading.Thread(target=work, name="standby-prepare", daemon=True)
            self._standby_thread.start()

    def wait_standby(self, timeout_s: float | None = None) -> None:
        """Wait for the background standby preparation (tests and benchmarks)."""
        thread = self._standby_thread
        if thread is not None:
            thread.join(timeout_s)

    def shutdown(self) -> None:
        """Retire the active instance and free the HMM's memory. Idempotent, best effort."""
        with self._lock:
            if self._is_shut_down:
                return
            self._is_shut_down = True
        self._closing.set()
        self._standby_superseded.set()  # a preparation waiting out its delay ends now
        self.processes.close()  # NOTE: first, so every rank retired from now on exits
        self._join_node_watch()  # NOTE: a registration in progress ends before the HMM does
        self.standby.shutdown()  # NOTE: first, so a boot that finishes now is retired, not pooled
        self.wait_standby()
        inst = self.active or self._starting
        with self._publish_lock:
            self._publish(is_accepting=False)  # nothing to route to from now on
        if inst is not None and inst.state is not InstanceState.RETIRED:
            try:
                inst.retire()
            except Exception:  # noqa: BLE001 - the HMM must still be freed
                logger.exception("coordinator: retiring %s failed", inst)
        if self.hmm is not None:
            try:
                self.hmm.shutdown()
            except Exception:  # noqa: BLE001
                logger.exception("coordinator: HMM shutdown failed")
        reap(self.config.shm_prefix)  # what a worker that died left on this node
        logger.info("coordinator: shut down")

    # ---- observation ---------------------------------------------------------------------

    @property
    def is_ready(self) -> bool:
        """An instance serves (a broken one is reported by the healer, see `Healer.is_broken`)."""
        return not self._is_shut_down and self.active is not None and self.active.is_serving

    async def check_health(self, timeout_s: float = 5.0) -> None:
        """Raise unless every rank of the active instance reports a live, ticking step loop."""
        inst = self.active
        if inst is None or not inst.is_serving:
            raise RuntimeError("no active instance")
        await asyncio.wait_for(asyncio.gather(*[r.check_health.remote() for r in inst.ranks]), timeout_s)

    async def rank_stats(self, timeout_s: float = 5.0) -> list[RankStats]:
        """The active instance's per-rank counters (empty if none is active)."""
        inst = self.active
        if inst is None or not inst.is_serving:
            return []
        return list(await asyncio.wait_for(asyncio.gather(*[r.stats.remote() for r in inst.ranks]), timeout_s))

    async def device_memory(self, timeout_s: float = 2.0) -> list[DeviceMemoryStats]:
        """Every registered device's memory (empty before start / after shutdown).

        NOTE: a device worker runs one method at a time, so during a scale's copies this
        waits for them (raises `TimeoutError` after `timeout_s`)."""
        hmm = self.hmm
        if hmm is None or self._is_shut_down:
            return []
        specs = sorted(hmm.devices.items())
        layout = hmm.layout
        by_kind = layout_memory(layout, list(hmm.adapters.values()), hmm.page_size) if layout is not None else {}
        usage = await asyncio.wait_for(
            asyncio.gather(*[hmm.worker(d).usage.remote() for d, _ in specs]), timeout_s
        )
        return [
            DeviceMemoryStats(d, spec.budget_bytes, u.used, u.peak, by_kind.get(d, {}))
            for (d, spec), u in zip(specs, usage, strict=True)
        ]

    def adapter_slots(self) -> list[AdapterSlotStats]:
        """Registered adapters and slots per kind (in-process, no Ray)."""
        kinds = [a.kind for a in list(self.adapters.adapters.values())]
        slots = {"esft": self.config.max_esft_adapters, "lora": self.config.max_loras}
        return [AdapterSlotStats(kind, kinds.count(kind), n) for kind, n in slots.items()]
