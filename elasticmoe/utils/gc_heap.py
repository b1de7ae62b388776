"""Keep the garbage collector's full passes off the serving path: freeze the startup heap.

CPython's collection of its oldest generation walks every object the collector tracks. A serving
process holds 200-240 K of them once torch, transformers, the tokenizer and the model are loaded.
Under the serving bench's load (64 streaming clients, the small model) the single server made such
a pass every 13-15 s, 137-148 ms each: that step, and the next token of every stream, waited for it
(the engine alone, 64 requests in flight: one pass of ~100 ms in 40 s). The startup heap (modules,
the model's layers, the tokenizer) lives as long as the process,
so `freeze_startup_heap` takes it out of the collector's sight (`gc.freeze`, as vLLM and SGLang do
once their engine is up). The passes then walk only what serving created since.

A frozen object is never collected, even once it is unreachable. A process that drops an engine
and may build another (an instance rank, whose process a later instance reuses) calls `thaw_heap`
first, so that the old engine's reference cycles, and the tensors they hold, go with the next
collection.
"""

from __future__ import annotations

import gc
import logging

logger = logging.getLogger(__name__)


def freeze_startup_heap(what: str) -> int:
    """Collect the start's garbage (frozen, it would stay for good), then freeze every object left.
    `what` names the process in the log. Returns the number of objects frozen in all."""
    gc.collect()
    gc.freeze()
    frozen = gc.get_freeze_count()
    logger.info("%s: %d startup objects frozen, out of the garbage collector's full passes", what, frozen)
    return frozen


def thaw_heap() -> None:
    """Give the frozen objects back to the collector (the oldest generation): before dropping what
    was frozen with the startup heap, so that its cycles can be collected."""
    gc.unfreeze()
