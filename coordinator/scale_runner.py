"""`ScaleRunner`: one scale at a time, each in a background thread; and the body of a scale request.

`POST /admin/scale` and the autoscaler start scales through `ScaleRunner.start`, so the same
validation and conflicts apply to both: 400 naming `dp` or `strategy`, 409 while a scale (or
an adapter change) runs, 503 without an active instance.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING

from pydantic import BaseModel, ConfigDict, Field

from coordinator.scale_events import ScaleConflict
from coordinator.strategies import DEFAULT_STRATEGY, STRATEGIES
from elasticmoe.entrypoints.openai.errors import OpenAIError
from elasticmoe.sampling_params import MAX_INT32

if TYPE_CHECKING:  # the ingress imports `ScaleRequest` from here: it need not load the scaler and instances
    from coordinator.scaler import Scaler


class ScaleRequest(BaseModel):
    # An admin request refuses fields it does not know: a typo, or a setting sent here that only a
    # restart changes, must not look applied.
    model_config = ConfigDict(extra="forbid")

    dp: int = Field(strict=True, ge=1, le=MAX_INT32,
                    description="Target data-/expert-parallel degree (ranks, one per device).")
    strategy: str = Field(
        DEFAULT_STRATEGY, description=f"How to scale: one of {', '.join(STRATEGIES)} (coordinator.strategies)."
    )


class ScaleRunner:
    """Starts scales in a background thread (one at a time); `join` waits for the running one."""

    def __init__(self, scaler: Scaler) -> None:
        self.scaler = scaler
        self.thread: threading.Thread | None = None

    def start(self, dp: int, strategy: str = DEFAULT_STRATEGY, lock_wait_s: float = 0.0) -> str:
        """The new event's id. Raises `OpenAIError`: 400 (bad dp/strategy), 409 (a scale runs, or an
        adapter change still holds its lock after `lock_wait_s`), 503."""
        try:
            event = self.scaler.start(dp, strategy, lock_wait_s)
        except ValueError as exc:
            param = "strategy" if str(exc).startswith("strategy") else "dp"
            raise OpenAIError(str(exc), param=param) from exc
        except ScaleConflict as exc:
            raise OpenAIError(str(exc), status_code=409, param="dp") from exc
        except RuntimeError as exc:
            raise OpenAIError(str(exc), status_code=503) from exc
        self.thread = threading.Thread(target=self.scaler.run, args=(event,), name=event.event_id, daemon=True)
        self.thread.start()
        return event.event_id

    def join(self, timeout_s: float = 120.0) -> None:
        if self.thread is not None:
            self.thread.join(timeout_s)
