"""Which LoRA adapters each DP rank likely holds, as one ingress's router sees it.

With slots of attention modules only (`--lora-target-modules` without the experts' modules) each
rank of an EP instance swaps its own LoRA slots (`engine.adapter_manager`), so the ranks hold
different adapters and the assignment (CoServe §4.2) should send a request where its adapter is.
The ranks do not report their slots per request; the router knows where it sent requests, and a
rank swaps an adapter in for the requests it receives. So a rank is taken to hold the last
`slots` distinct adapters routed to it (an LRU estimate: the rank's own eviction, by usage
probability, may keep others; other ingress replicas' requests are not seen).
A wrong guess costs a swap on the rank, never a request.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Container, Mapping


class RecentLora:
    """The last `slots` distinct LoRA adapters routed to each of `num_ranks` ranks."""

    def __init__(self, num_ranks: int, slots: int) -> None:
        if num_ranks < 1 or slots < 1:
            raise ValueError(f"recent lora: need >= 1 rank and slot, got {num_ranks}, {slots}")
        self.slots = slots
        self._recent: list[OrderedDict[str, None]] = [OrderedDict() for _ in range(num_ranks)]

    def record(self, rank: int, adapter: str) -> None:
        """A request for `adapter` went to `rank`: it is the rank's most recent adapter."""
        recent = self._recent[rank]
        recent[adapter] = None
        recent.move_to_end(adapter)
        if len(recent) > self.slots:
            recent.popitem(last=False)

    def view(self, rank: int, shared: Container[str], kind_of: Mapping[str, str]) -> RankResidency:
        """What `rank` holds: its recent LoRA adapters, and of the others what the instance holds."""
        return RankResidency(self._recent[rank], shared, kind_of)


class RankResidency(Container[str]):
    """A rank's resident adapters for `RankState.resident`: a LoRA adapter when it is among the
    rank's recent ones (and accepted: in `shared`), any other kind when the instance holds it."""

    __slots__ = ("_recent", "_shared", "_kind_of")

    def __init__(self, recent: Container[str], shared: Container[str], kind_of: Mapping[str, str]) -> None:
        self._recent, self._shared, self._kind_of = recent, shared, kind_of

    def __contains__(self, adapter: object) -> bool:
        if adapter not in self._shared:
            return False
        return self._kind_of.get(adapter, "lora") != "lora" or adapter in self._recent  # type: ignore[call-overload]
