"""Request arranging (CoServe §4.2): the order in which a window of waiting requests is offered
for admission, and its FCFS baseline (Samba-CoE). Pure functions over the window, registered by
name (`ARRANGERS`, `arranger`).

- **coserve**: "once a request is assigned to a queue, the request scheduler arranges it behind
  other requests that use the same expert", so each expert is loaded once per group. Over a
  window in arrival order that is a stable grouping by `key`: groups in the order of their
  oldest request, arrival order inside a group.
- **fcfs**: the window as it came.

No-starvation (both): the first request of the result is the window's oldest, and a request is
passed only by younger requests of the window that share an older request's key. Run by a
scheduler that offers the window first and admits requests of one key alike (ready or not
together), the oldest ready request always starts first, so a request with p ready requests
ahead of it starts within p + 1 admitting steps (`elasticmoe.engine.scheduler`).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from typing import TypeVar

T = TypeVar("T")


def arrange_by_dependency(window: Sequence[T], key: Callable[[T], Hashable]) -> list[T]:
    """`window` (arrival order) grouped by `key` (the adapter, or set of adapters, a request
    depends on): groups ordered by their oldest request, members in arrival order."""
    groups: dict[Hashable, list[T]] = {}
    for item in window:
        groups.setdefault(key(item), []).append(item)
    return [item for group in groups.values() for item in group]


def arrange_fcfs(window: Sequence[T], key: Callable[[T], Hashable]) -> list[T]:
    """First come, first served: `window` unchanged (`key` unused)."""
    return list(window)


ARRANGERS: dict[str, Callable[[Sequence, Callable], list]] = {
    "coserve": arrange_by_dependency,
    "fcfs": arrange_fcfs,
}


def arranger(name: str) -> Callable[[Sequence, Callable], list]:
    """The registered arranging function `name`; `ValueError` naming `request_arranging` otherwise."""
    if name not in ARRANGERS:
        raise ValueError(f"request_arranging: expected one of {sorted(ARRANGERS)}, got {name!r}")
    return ARRANGERS[name]
