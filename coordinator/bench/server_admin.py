"""What the benchmarks that start an elastic server share: the model presets, and waiting on
the server's admin API (a scale event, the active dp, the standby pool).

Every function that reports takes `progress` (one line to stderr: `report_output.progress_printer`),
so its lines carry the name of the benchmark that runs it.
"""

from __future__ import annotations

import argparse
import asyncio
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

PRESETS = {  # preset -> (model dir, device memory GiB, KV cache GiB per device)
    "tiny": ("models/tiny-qwen3-moe", 1 / 16, 1 / 128),
    "small": ("models/small-qwen3-moe", 1.0, 1 / 16),
}
VLLM_MODELS = {"tiny": "models/tiny-vllm-qwen3-moe"}  # vLLM's CPU attention needs head_dim >= 32

Progress = Callable[[str], None]


def resolve_model(args: argparse.Namespace, progress: Progress) -> str:
    """The model directory (`args.model`, else the preset's: `args.preset`, and `args.backend` if
    the benchmark has one); a preset's checkpoint is built (`elasticmoe make-model`) if missing."""
    default = PRESETS[args.preset][0]
    if getattr(args, "backend", "native") == "vllm":
        default = VLLM_MODELS.get(args.preset, default)
    model_dir = args.model or default
    if not (Path(model_dir) / "config.json").is_file():
        if args.model is not None and args.model not in (*(p[0] for p in PRESETS.values()), *VLLM_MODELS.values()):
            raise SystemExit(f"error: --model: {model_dir} has no config.json")
        name = Path(model_dir).name
        preset = "tiny-vllm" if "tiny-vllm" in name else "tiny" if "tiny" in name else "small"
        progress(f"building {model_dir} (make-model --arch qwen3_moe --preset {preset} --seed 0)")
        from elasticmoe.tools.make_model import make_model

        make_model("qwen3_moe", preset, seed=0, out=model_dir)
    return model_dir


async def wait_event(client: httpx.AsyncClient, event_id: str, timeout_s: float) -> dict[str, Any]:
    """The scale event once it is no longer running; after `timeout_s` as it is then, with an `error`."""
    deadline = time.monotonic() + timeout_s
    while True:
        event: dict[str, Any] = (await client.get(f"/admin/scale/{event_id}")).json()
        if event["state"] != "running":
            return event
        if time.monotonic() > deadline:
            event["error"] = f"still running after {timeout_s:.0f}s"
            return event
        await asyncio.sleep(0.1)


async def active_dp(client: httpx.AsyncClient) -> int:
    return int((await client.get("/admin/status")).json()["active_config"]["dp"])


async def ensure_dp(client: httpx.AsyncClient, dp: int, timeout_s: float, progress: Progress) -> None:
    """Move the server to `dp` with an (unmeasured) elastic scale, if it is elsewhere."""
    deadline = time.monotonic() + timeout_s
    while (await client.get("/admin/status")).json()["scale_event"] is not None:  # e.g. a timed-out event
        if time.monotonic() > deadline:
            raise RuntimeError(f"a scale event is still running after {timeout_s:.0f}s")
        await asyncio.sleep(0.5)
    current = await active_dp(client)
    if current == dp:
        return
    progress(f"reset: elastic scale dp {current} -> {dp} (unmeasured)")
    r = await client.post("/admin/scale", json={"dp": dp, "strategy": "elastic"})
    r.raise_for_status()
    event = await wait_event(client, r.json()["event_id"], timeout_s)
    if event["state"] != "succeeded" or await active_dp(client) != dp:
        raise RuntimeError(f"could not reset the server to dp {dp}: {event}")


async def wait_standby(client: httpx.AsyncClient, timeout_s: float, progress: Progress) -> None:
    """Wait until the server's background standby preparation (dp-1, dp+1) is done: strategies
    with pre-initialisation are measured as deployed (the paper assumes the target is
    pre-initialised, §7.8), and no boot competes for the cores during the measurement."""
    deadline = time.monotonic() + timeout_s
    while (await client.get("/admin/status")).json()["standby"]["preparing"]:
        if time.monotonic() > deadline:
            progress("warning: standby preparation still running; measuring anyway")
            return
        await asyncio.sleep(0.2)
