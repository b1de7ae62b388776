"""Faults injected into a running elastic server under streaming load, and what clients saw.

The harness of `coordinator.bench.chaos` and of the chaos tests. `run_fault` starts one
streaming greedy request per prompt, kills a process once every stream is producing
(SIGKILL: no chance to clean up), lets every stream end, and measures from the client's
side (failures, texts against an undisturbed run, the longest pause of any stream, how long
`/ready` said 503) and from the server's (the repair's detection and end, requests continued
on another instance, tokens recomputed). The server must run on this node (pids are local).

Faults (`FAULTS`): a rank of the active instance; the device worker under its rank 0; the
old instance's rank while a scale is preparing (the scale must finish on the new instance);
the coordinator replica (Serve restarts it; the ingress holds the streams meanwhile and
continues them on the new coordinator's instance); the ingress replica (Serve restarts it; the
streams through it end with it: their HTTP connections terminate in that process); a whole
worker node holding a rank (its raylet and every process under it; needs a multi-node cluster,
`kill_node`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import signal
import time
from collections.abc import Callable, Sequence
from typing import Any

import httpx

from coordinator.bench.loadgen import RequestRecord, stream_completion
from hmm.memory.lease import reap

FAULTS = {
    "rank": "kill -9 a rank of the active instance",
    "device": "kill -9 the device worker under the active rank 0",
    "mid-scale": "kill -9 the old instance's rank while a scale prepares",
    "coordinator": "kill -9 the coordinator replica (Serve restarts it; the ingress holds its streams)",
    "ingress": "kill -9 the ingress replica (Serve restarts it; the streams through it end with it)",
    "node": "kill -9 a worker node holding a rank: its raylet and every process on it",
}


@dataclasses.dataclass
class FaultResult:
    fault: str
    dp_before: int
    dp_after: int | None
    detect_s: float | None  # kill -> the server saw the fault (a restart: /ready said 503)
    recover_s: float | None  # kill -> an instance serves again (the repair finished; a restart: /ready 200)
    max_stall_s: float  # longest pause of any stream after the kill
    baseline_stall_s: float  # longest pause of any stream before it
    ready_503_s: float  # how long /ready answered 503
    requests: int
    failed: int
    identical: int  # streams whose whole text equals the undisturbed run's
    recovered: int  # requests the server continued on another instance
    tokens_recomputed: int
    events: list[str]  # the scale/heal events it caused
    errors: list[str]  # what failed requests saw
    orphaned_shm_files: int | None = None  # /dev/shm files whose owner is gone, once recovered

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def body(model: str, prompt: list[int], max_tokens: int) -> dict[str, Any]:
    return {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True}


async def undisturbed(client: httpx.AsyncClient, model: str, prompts: Sequence[list[int]], max_tokens: int) -> list[str]:
    """Each prompt's text on the running server, nothing injected (the oracle)."""
    records = [RequestRecord(i, 0.0, len(p), max_tokens) for i, p in enumerate(prompts)]
    await asyncio.gather(*(stream_completion(client, r, body(model, p, max_tokens), time.monotonic)
                           for r, p in zip(records, prompts, strict=True)))
    failed = [r.error for r in records if not r.is_ok]
    if failed:
        raise RuntimeError(f"the undisturbed run failed: {failed}")
    return [r.text for r in records]


async def status(client: httpx.AsyncClient) -> dict[str, Any]:
    response = await client.get("/admin/status", timeout=30)
    response.raise_for_status()  # 503 while the coordinator restarts
    return response.json()


async def settle(client: httpx.AsyncClient, dp: int, timeout_s: float = 120) -> None:
    """Bring the server to `dp` (a scale if needed) and wait until nothing runs in the background
    (no scale, no standby boot, no fault under repair), so every fault starts from the same state."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        st = await status(client)
        quiet = st["scale_event"] is None and not st["standby"]["preparing"] and not st["health"]["faults"]
        if quiet and (await client.get("/ready")).status_code == 200:
            if st["active_config"]["dp"] == dp:
                return
            # NOTE: asked for whenever quiet at another dp: a repair of an earlier fault may have
            # moved the server to a ready standby of another dp after a first look.
            r = await client.post("/admin/scale", json={"dp": dp})
            if r.status_code != 409:  # 409: a repair or scale started meanwhile; look again
                r.raise_for_status()
        await asyncio.sleep(0.2)
    raise TimeoutError(f"the server did not settle at dp {dp} in {timeout_s} s: {st}")


def _kill(pid: int | None, what: str) -> tuple[float, float]:
    """SIGKILL `pid`; returns when, as (monotonic, epoch) seconds."""
    if pid is None:
        raise RuntimeError(f"no pid for {what}")
    os.kill(pid, signal.SIGKILL)
    return time.monotonic(), time.time()


async def _inject(client: httpx.AsyncClient, fault: str, st: dict[str, Any],
                  kill_node: Callable[[str], object] | None = None) -> tuple[float, float]:
    """Kill what `fault` names, as found in the status `st` taken just before; returns when."""
    ranks = st["instance"]["ranks"]
    if fault == "node":
        if kill_node is None:
            raise ValueError("fault node: needs a multi-node cluster (--nodes)")
        nodes = (await client.get("/admin/nodes")).json()["nodes"]
        home = next((n["ray_node_id"] for n in nodes if n["home"]), None)  # None: the head offers no device
        victim = next((r["ray_node_id"] for r in reversed(ranks) if r["ray_node_id"] != home), None)
        if victim is None:
            raise RuntimeError("fault node: every rank runs on the head's node, and the head is not killed (the "
                               "coordinator lives there); give the head no devices, e.g. --nodes 0,1,1")
        kill_node(victim)
        return time.monotonic(), time.time()
    if fault == "rank":
        return _kill(ranks[-1]["pid"], "the last rank")
    if fault == "device":
        device = ranks[0]["device_id"]
        return _kill(next(d["pid"] for d in st["devices"] if d["device_id"] == device), f"device {device}")
    if fault == "mid-scale":
        # A scale that boots its target instance, which takes seconds: to a dp the standby pool does
        # not hold, else (the pool holds every other dp, as earlier repairs may leave it) with the
        # ablation that boots the target during the scale.
        dp, pooled = st["active_config"]["dp"], set(st["standby"]["dps"])
        others = [d for d in range(1, len(st["devices"]) + 1) if d != dp]
        unpooled = [d for d in others if d not in pooled]
        scale = {"dp": unpooled[0]} if unpooled else {"dp": others[0], "strategy": "no_preinit"}
        (await client.post("/admin/scale", json=scale)).raise_for_status()
        await asyncio.sleep(0.3)
        return _kill(ranks[0]["pid"], "the old rank")
    if fault == "coordinator":
        return _kill(st["coordinator"]["pid"], "the coordinator")
    if fault == "ingress":
        return _kill(st["ingress"]["pid"], "the ingress")
    raise ValueError(f"fault: one of {sorted(FAULTS)}, got {fault!r}")


async def run_fault(
    client: httpx.AsyncClient,
    fault: str,
    model: str,
    prompts: Sequence[list[int]],
    reference: Sequence[str],
    max_tokens: int,
    kill_after_chunks: int = 3,
    timeout_s: float = 180,
    shm_prefix: str | None = None,
    kill_node: Callable[[str], object] | None = None,
) -> FaultResult:
    """Inject `fault` under one stream per prompt; see the module docstring. With `shm_prefix`,
    also count the server's /dev/shm files left without a live owner once it recovered."""
    before = await status(client)
    records = [RequestRecord(i, 0.0, len(p), max_tokens) for i, p in enumerate(prompts)]
    streams = [asyncio.create_task(stream_completion(client, r, body(model, p, max_tokens), time.monotonic))
               for r, p in zip(records, prompts, strict=True)]
    deadline = time.monotonic() + 60
    while not all(len(r.token_times_s) >= kill_after_chunks or r.finished_s for r in records):
        if time.monotonic() > deadline:
            raise TimeoutError("the streams did not start")
        await asyncio.sleep(0.01)
    t_kill, wall_kill = await _inject(client, fault, before, kill_node)
    ready = [(t_kill, 200)]

    async def poll_ready() -> None:
        while not all(s.done() for s in streams) or ready[-1][1] != 200:
            try:
                code = (await client.get("/ready", timeout=5)).status_code
            except httpx.HTTPError:
                code = 0  # nobody answers: the coordinator is restarting
            ready.append((time.monotonic(), code))
            await asyncio.sleep(0.05)

    await asyncio.wait_for(asyncio.gather(*streams, poll_ready()), timeout_s)
    after = await _wait_quiet(client, timeout_s, before, wall_kill)
    result = _result(fault, before, after, records, reference, ready, t_kill, wall_kill)
    if shm_prefix is not None:
        result.orphaned_shm_files = len(reap(shm_prefix, dry_run=True))
    return result


async def _wait_quiet(client: httpx.AsyncClient, timeout_s: float, before: dict[str, Any],
                      wall_kill: float) -> dict[str, Any]:
    """The status once the fault was repaired (a repair event that finished after the kill, or a
    restarted replica) and nothing runs or is open. NOTE: a repair may end after the streams, and
    even start after them: a dead device worker stalls no stream, and its death is seen ~1 s later."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            st = await status(client)
            restarted = any(st[p]["pid"] != before[p]["pid"] for p in ("coordinator", "ingress"))
            repaired = restarted or any((e["strategy"] == "heal" or e.get("fault")) and e["finished_at"] is not None
                                        and e["finished_at"] >= wall_kill for e in st["scale_events"])
            if repaired and st["scale_event"] is None and not st["health"]["faults"] and st["health"]["ready"]:
                return st
        except (httpx.HTTPError, ValueError):
            pass
        if time.monotonic() > deadline:
            raise TimeoutError("the server did not recover")
        await asyncio.sleep(0.2)


def _result(fault: str, before: dict[str, Any], after: dict[str, Any], records: list[RequestRecord],
            reference: Sequence[str], ready: list[tuple[float, int]], t_kill: float, wall_kill: float) -> FaultResult:
    new_events = [e for e in after["scale_events"] if (e["finished_at"] or wall_kill) >= wall_kill]
    repair = next((e for e in new_events if e["strategy"] == "heal" or e.get("fault")), None)
    restarted = any(after[p]["pid"] != before[p]["pid"] for p in ("coordinator", "ingress"))
    # A poll's time is when its answer came (or was refused: no ingress listens while Serve restarts it).
    first_not_ready = next((t for t, code in ready[1:] if code != 200), None)
    last_not_ready = max((t for t, code in ready[1:] if code != 200), default=t_kill)
    first_ready = next((t for t, code in ready[1:] if code == 200 and t > last_not_ready), None)
    if restarted:  # a new replica: no repair event; it serves once /ready says so
        detect_s = None if first_not_ready is None else first_not_ready - t_kill
        recover_s = None if first_ready is None else first_ready - t_kill
    else:
        detect_s = None if repair is None else (repair["detected_at"] or repair["started_at"]) - wall_kill
        recover_s = None if repair is None else repair["finished_at"] - wall_kill
    counters = ("recovered", "tokens_recomputed")
    # The ingress counts requests continued elsewhere; a new ingress counts from 0.
    base = dict.fromkeys(counters, 0) if after["ingress"]["pid"] != before["ingress"]["pid"] else before["requests"]
    gaps_before: list[float] = []
    gaps_after: list[float] = []
    for r in records:
        times = r.token_times_s
        for a, b in zip(times, times[1:], strict=False):
            (gaps_after if b > t_kill else gaps_before).append(b - a)
    ready_503 = sum(b[0] - a[0] for a, b in zip(ready, ready[1:], strict=False) if a[1] != 200)
    return FaultResult(
        fault=fault, dp_before=before["active_config"]["dp"], dp_after=after["active_config"]["dp"],
        detect_s=detect_s, recover_s=recover_s,
        max_stall_s=max(gaps_after, default=0.0), baseline_stall_s=max(gaps_before, default=0.0),
        ready_503_s=ready_503, requests=len(records), failed=sum(not r.is_ok for r in records),
        identical=sum(r.is_ok and r.text == ref for r, ref in zip(records, reference, strict=True)),
        recovered=after["requests"]["recovered"] - base["recovered"],
        tokens_recomputed=after["requests"]["tokens_recomputed"] - base["tokens_recomputed"],
        events=[f"{e['strategy']} {e['from_dp']}->{e['to_dp']} {e['state']}" + (f" ({e['fault']})" if e.get("fault")
                else "") for e in new_events],
        errors=sorted({r.error or "" for r in records if not r.is_ok}),
    )
