"""The ingress's adapter host: a registration returns once this ingress routes by it."""

from __future__ import annotations

import asyncio
import logging

from coordinator.coordinator_client import RemoteAdapterHost


class FakeCoordinator:
    """Answers at once; the published adapter list reaches the ingress `lag` polls later."""

    def __init__(self, lag: int) -> None:
        self.lag, self.calls, self.published, self.polls = lag, [], (), 0

    async def call(self, method: str, *args):
        self.calls.append((method, *args))
        name = args[0]
        self.target = (name,) if method.startswith("load") else ()
        self.polls = 0
        return {"slot": 0} if method.startswith("load") else True

    def served(self) -> tuple[str, ...]:
        self.polls += 1
        if self.polls > self.lag:
            self.published = self.target
        return self.published


def test_a_load_and_an_unload_return_once_the_routing_state_shows_them():
    coordinator = FakeCoordinator(lag=5)
    host = RemoteAdapterHost(coordinator, coordinator.served, poll_s=0.001)  # type: ignore[arg-type]
    assert asyncio.run(host.load_lora("law", "/adapters/law")) == {"slot": 0}
    assert coordinator.served() == ("law",) and coordinator.polls >= 6  # it waited for the state
    assert asyncio.run(host.load_esft("med", "/adapters/med", 0.5)) == {"slot": 0}
    assert coordinator.calls[1] == ("load_esft", "med", "/adapters/med", 0.5)
    assert asyncio.run(host.unload("med")) is True and coordinator.served() == ()


def test_a_state_that_never_follows_costs_a_warning_not_the_registration(caplog):
    coordinator = FakeCoordinator(lag=10**9)  # the coordinator became unreachable after the change
    host = RemoteAdapterHost(coordinator, coordinator.served, publish_wait_s=0.05, poll_s=0.001)  # type: ignore[arg-type]
    with caplog.at_level(logging.WARNING):
        assert asyncio.run(host.load_lora("law", "/adapters/law")) == {"slot": 0}
    assert "did not follow" in caplog.text
