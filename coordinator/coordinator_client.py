"""The ingress's calls to the coordinator (a Serve `DeploymentHandle`), with errors as clients see them.

A call returns the coordinator's answer or raises what it raised (its own exception, unwrapped
from Ray's wrapper: an `OpenAIError` keeps its status, an adapter error its `param`); a
coordinator that is gone, restarting or too slow becomes a 503 that says so. No remote
traceback ever reaches a client.

`RemoteAdapterHost` is the ingress's `AdapterHost`: the coordinator opens and validates an
adapter's files (its `AdapterError`s come back here as 400s naming the field), then loads it on
every rank. The ingress never opens an adapter's files.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any

from ray.exceptions import ActorUnavailableError, RayActorError

from coordinator.routing_state import RoutingState
from elasticmoe.entrypoints.openai.errors import OpenAIError
from elasticmoe.errors import describe_error, unwrap_remote

logger = logging.getLogger(__name__)

_UNREACHABLE = (RayActorError, ActorUnavailableError, TimeoutError, ConnectionError)


class CoordinatorUnavailable(OpenAIError):
    """The coordinator cannot answer now (restarting after a crash, or busy beyond the timeout)."""

    def __init__(self, what: str) -> None:
        super().__init__(f"The coordinator is unavailable ({what}); retry shortly.", status_code=503)


class CoordinatorClient:
    def __init__(self, handle: Any, timeout_s: float = 60.0) -> None:
        self.handle = handle
        self.timeout_s = timeout_s

    async def call(self, method: str, *args: Any, timeout_s: float | None = None) -> Any:
        """`method(*args)` on the coordinator; raises its error, or `CoordinatorUnavailable`."""
        try:
            return await asyncio.wait_for(getattr(self.handle, method).remote(*args), timeout_s or self.timeout_s)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            original = unwrap_remote(exc)
            if isinstance(original, _UNREACHABLE) or _is_serve_unavailable(original):
                raise CoordinatorUnavailable(describe_error(original)) from None
            raise original from None

    async def routing(self, after: tuple[str, int] | None, timeout_s: float) -> RoutingState:
        """The follower's long poll (its errors are the follower's business)."""
        return await self.handle.routing.remote(after, timeout_s)

    def notify_rank_failure(self) -> None:
        """Fire and forget: the healer probes on its own anyway."""
        try:
            self.handle.notify_rank_failure.remote()
        except Exception as exc:  # noqa: BLE001 - a hint, never worth failing a request for
            logger.info("could not tell the coordinator about a rank failure (%s)", describe_error(exc))

    def swap_unwanted(self, adapter: str) -> None:
        """Fire and forget: without it the coordinator holds the adapter's slot for its waiters at
        most `esft_residency.REACH_WAIT_S`."""
        try:
            self.handle.swap_unwanted.remote(adapter)
        except Exception as exc:  # noqa: BLE001 - a hint, never worth failing anything for
            logger.info("could not tell the coordinator adapter %r is unwanted (%s)", adapter, describe_error(exc))


def _is_serve_unavailable(exc: BaseException) -> bool:
    # Serve's own errors when a deployment has no running replica (names differ across releases).
    return type(exc).__module__.startswith("ray.serve") and "navailable" in type(exc).__name__


class RemoteAdapterHost:
    """`AdapterHost` over the coordinator: every rank of the active instance loads the adapter.

    A load or unload returns once this ingress routes by it: the coordinator publishes the new
    adapter list, and the ingress's routing state follows it by a long poll, a few milliseconds
    later. Without the wait a client that registered an adapter and used it at once got a 404
    ("model does not exist") in that gap."""

    def __init__(self, coordinator: CoordinatorClient, served: Callable[[], tuple[str, ...]],
                 publish_wait_s: float = 10.0, poll_s: float = 0.005) -> None:
        """`served()`: the adapters this ingress's routing state accepts requests for now."""
        self.coordinator = coordinator
        self.served = served
        self.publish_wait_s, self.poll_s = publish_wait_s, poll_s

    async def load_esft(self, name: str, path: str, usage_probability: float | None = None) -> dict[str, Any]:
        info = dict(await self.coordinator.call("load_esft", name, path, usage_probability))
        await self._routed(name, True)
        return info

    async def load_lora(self, name: str, path: str, usage_probability: float | None = None) -> dict[str, Any]:
        info = dict(await self.coordinator.call("load_lora", name, path, usage_probability))
        await self._routed(name, True)
        return info

    async def load_router(self, name: str, path: str, usage_probability: float | None = None) -> dict[str, Any]:
        # A router is no model id of its own (requests name it in `lora_routing`): nothing to wait for.
        return dict(await self.coordinator.call("load_router", name, path, usage_probability))

    async def unload(self, name: str) -> bool:
        done = bool(await self.coordinator.call("unload_adapter", name))
        await self._routed(name, False)
        return done

    async def describe(self) -> list[dict[str, Any]]:
        return list(await self.coordinator.call("describe_adapters"))

    async def _routed(self, name: str, accepted: bool) -> None:
        """Until this ingress's routing state accepts requests for `name` (or no longer does); after
        `publish_wait_s` (the coordinator unreachable) only a warning: the change itself was made."""
        deadline = time.monotonic() + self.publish_wait_s
        while (name in self.served()) != accepted:
            if time.monotonic() > deadline:
                logger.warning("adapter %r: the routing state did not follow the change within %.0fs", name,
                               self.publish_wait_s)
                return
            await asyncio.sleep(self.poll_s)
