"""`InstanceManager`: an LRU pool of standby instances (paper §4.5).

Standby instances (processes up, group formed, skeleton built, no weights) are
kept for anticipated configurations, typically dp-1 and dp+1 of the active one,
so a scale skips the cold start and only attaches + warms up. The pool holds
at most `capacity` instances; adding one more retires the least recently used.

Invariants: every pooled instance is in state `standby`; an instance is either
in the pool or handed out (`take`), never both, so eviction never retires an
instance somebody is attaching. Which instance is active is the coordinator's business
(`coordinator.active`), not the pool's.
NOTE: `prepare` boots outside the lock (a boot takes ~2 s), so a `take` never
waits behind the boot of another configuration; a `take` of the configuration
being booted waits for that boot (it finishes sooner than a second one, which
would also compete for the same cores). An instance that finishes booting after
`shutdown` is retired.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable
from typing import Any, Protocol

from elasticmoe.config import EngineOptions
from imm.lifecycle import InstanceState

logger = logging.getLogger(__name__)


class ManagedInstance(Protocol):
    dp: int
    state: InstanceState

    def retire(self) -> None: ...


Factory = Callable[[int], ManagedInstance]


def instance_factory(
    model_dir: str, engine_options: EngineOptions | None = None, paced: bool = True
) -> Factory:
    """Factory of real standby `Instance`s (imported lazily so unit tests need no Ray). Paced by
    default: the pool boots in the background, beside a serving instance (`Instance.create_standby`)."""
    from imm.instance import Instance

    return lambda dp: Instance.create_standby(model_dir, dp, engine_options, paced=paced)


class InstanceManager:
    def __init__(self, factory: Factory, capacity: int = 2) -> None:
        if capacity < 0:
            raise ValueError(f"capacity: must be >= 0, got {capacity}")
        self.factory, self.capacity = factory, capacity
        self.pool: OrderedDict[int, ManagedInstance] = OrderedDict()  # dp -> standby, oldest first
        self.num_hits = self.num_misses = self.num_evictions = 0
        self._closed = False
        self._booting: dict[int, threading.Event] = {}  # dp -> set when its background boot ends
        self._lock = threading.RLock()

    def prepare(self, dps: Iterable[int]) -> None:
        """Make sure a standby instance exists for each dp (most recently used: the last one)."""
        for dp in dps:
            with self._lock:
                if self._closed:
                    return
                if dp in self.pool:
                    self.pool.move_to_end(dp)
                    continue
                if dp in self._booting:  # another preparation boots it
                    continue
                booted = self._booting[dp] = threading.Event()
            try:
                inst = self.factory(dp)
                with self._lock:
                    if not self._closed and dp not in self.pool:
                        self._put(inst)
                        continue
                inst.retire()  # shut down meanwhile
            finally:
                with self._lock:
                    del self._booting[dp]
                booted.set()

    def take(
        self, dp: int, factory: Factory | None = None, fits: Callable[[Any], bool] | None = None
    ) -> ManagedInstance:
        """A standby instance of `dp`, removed from the pool: a pooled one (or the one booting in
        the background) if `fits` it (default: any), else a fresh one from `factory` (default:
        the pool's own)."""
        while True:
            with self._lock:
                inst = self.pool.pop(dp, None)
                if inst is not None and inst.state is InstanceState.STANDBY and (fits is None or fits(inst)):
                    self.num_hits += 1
                    return inst
                if inst is not None:  # never hand out a non-standby or misplaced instance
                    logger.warning("pooled instance %r is not standby or not placed for this scale; replacing it",
                                   inst)
                    inst.retire()
                booting = self._booting.get(dp)
                if booting is None:
                    self.num_misses += 1
                    break
            booting.wait()  # then take it from the pool (or boot, if that boot failed)
        return (factory or self.factory)(dp)

    def _put(self, inst: ManagedInstance) -> None:
        if self.capacity == 0:
            inst.retire()
            return
        self.pool[inst.dp] = inst
        while len(self.pool) > self.capacity:
            dp, victim = self.pool.popitem(last=False)
            self.num_evictions += 1
            logger.info("evicting standby instance dp=%d", dp)
            victim.retire()

    def retire_where(self, condition: Callable[[ManagedInstance], bool]) -> int:
        """Retire the pooled instances for which `condition` holds (e.g. a rank on a node that
        left); returns how many."""
        with self._lock:
            victims = [(dp, inst) for dp, inst in self.pool.items() if condition(inst)]
            for dp, _ in victims:
                del self.pool[dp]
        for _, inst in victims:
            try:
                inst.retire()
            except Exception:  # noqa: BLE001 - its ranks may be gone with their node
                logger.warning("retiring pooled instance %r failed", inst, exc_info=True)
        return len(victims)

    def shutdown(self) -> None:
        """Retire the pool (and every instance that finishes booting later)."""
        with self._lock:
            self._closed = True
            instances = list(self.pool.values())
            self.pool.clear()
        for inst in instances:
            if inst.state is not InstanceState.RETIRED:
                inst.retire()
