"""The load generator's runner: streamed completions to a server at a chosen arrival pattern.

Drives `/v1/completions` (SSE) of the single server or the elastic server. The arrival times
(`coordinator.bench.arrivals`) and the request shapes (`coordinator.bench.request_shapes`)
depend only on the seed; sending is open-loop, so a request's TTFT includes any wait behind
the server. Scale events of an elastic server can be watched (polled on `GET /admin/status`).
The CLI is `coordinator.bench.load`; figures come from `coordinator.bench.load_report`:

    spec = LoadSpec(Ramp.linear(1, 8, 60), duration_s=60, mix=AdapterMix.single("base"))
    result = await run_load(spec, "http://127.0.0.1:8000", watch_scale_events=True)
    summary = summarize(result.records, spec.duration_s, slo_ttft_s=2.0, slo_tpot_s=0.2)
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import random
import signal
import time
from collections.abc import Callable, Iterator
from typing import Any, Literal

import httpx

from coordinator.bench.arrivals import RateSchedule
from coordinator.bench.load_report import events_on_axis
from coordinator.bench.loadgen import LoadResult, RequestRecord, stream_completion
from coordinator.bench.request_shapes import AdapterMix, LengthDist, make_prompt

logger = logging.getLogger(__name__)

ADMIN_UNSUPPORTED = (401, 403, 404)  # a single server, or no admin rights: no scale events


@dataclasses.dataclass(frozen=True, slots=True)
class LoadSpec:
    """What to send and when; everything but the server. Two runs of one spec send the same requests."""

    schedule: RateSchedule
    duration_s: float  # arrivals fall in [0, duration_s)
    mix: AdapterMix  # each request's `model`
    prompt_len: LengthDist = LengthDist("fixed", 32)
    output_len: LengthDist = LengthDist("fixed", 32)  # max_tokens, with ignore_eos: exact
    prompt_kind: Literal["tokens", "text"] = "tokens"  # random token ids, or random words
    vocab_size: int = 512  # token-id prompts draw ids below this
    seed: int = 0

    def __post_init__(self) -> None:
        if not self.duration_s > 0:
            raise ValueError(f"duration_s: must be > 0, got {self.duration_s}")
        if self.prompt_kind not in ("tokens", "text"):
            raise ValueError(f"prompt_kind: want tokens or text, got {self.prompt_kind!r}")
        if self.vocab_size <= 5:
            raise ValueError(f"vocab_size: must exceed 5 (special ids), got {self.vocab_size}")

    def to_dict(self) -> dict[str, Any]:
        return {
            **self.schedule.to_dict(), "duration_s": self.duration_s,
            "models": dict(zip(self.mix.names, self.mix.probabilities, strict=True)),
            "prompt_len": self.prompt_len.spec(), "output_len": self.output_len.spec(),
            "prompt_kind": self.prompt_kind, "vocab_size": self.vocab_size, "seed": self.seed,
        }


@dataclasses.dataclass(frozen=True, slots=True)
class PlannedRequest:
    request_id: int
    arrival_s: float
    model: str
    prompt: list[int] | str
    prompt_len: int
    max_tokens: int

    def body(self) -> dict[str, Any]:
        return {
            "model": self.model, "prompt": self.prompt, "max_tokens": self.max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True},
        }


def plan_requests(spec: LoadSpec) -> Iterator[PlannedRequest]:
    """The run's requests in arrival order. Arrivals and shapes use separate seeded streams, so the
    arrival times do not change with the length specs or the mix. Lazy: prompts are made on demand."""
    arrivals = spec.schedule.arrivals(spec.duration_s, random.Random(f"{spec.seed}:arrivals"))
    rng = random.Random(f"{spec.seed}:requests")
    for i, t in enumerate(arrivals):
        model = spec.mix.sample(rng)
        prompt_len, max_tokens = spec.prompt_len.sample(rng), spec.output_len.sample(rng)
        prompt = make_prompt(rng, prompt_len, spec.prompt_kind, spec.vocab_size)
        yield PlannedRequest(i, t, model, prompt, prompt_len, max_tokens)


@dataclasses.dataclass
class LoadProgress:
    """Live counters of a run (read by the progress bar)."""

    duration_s: float
    t0: float | None = None  # monotonic start, set when sending begins
    num_sent: int = 0
    num_ok: int = 0
    num_failed: int = 0

    @property
    def num_in_flight(self) -> int:
        return self.num_sent - self.num_ok - self.num_failed

    @property
    def elapsed_s(self) -> float:
        return 0.0 if self.t0 is None else time.monotonic() - self.t0


async def run_load(
    spec: LoadSpec,
    base_url: str,
    *,
    api_key: str | None = None,
    admin_key: str | None = None,
    request_timeout_s: float = 300.0,
    drain_timeout_s: float | None = None,
    stop: asyncio.Event | None = None,
    progress: LoadProgress | None = None,
    on_record: Callable[[RequestRecord], None] | None = None,
    watch_scale_events: bool = False,
    poll_interval_s: float = 1.0,
    transport: httpx.AsyncBaseTransport | None = None,
) -> LoadResult:
    """Send `spec`'s requests to `base_url` on schedule, then wait for those in flight.

    Stops sending early when `stop` is set. Requests still running `drain_timeout_s` (default:
    `request_timeout_s`) after the last arrival are cancelled and recorded as failed. With
    `watch_scale_events`, `GET /admin/status` is polled every `poll_interval_s` (with `admin_key`,
    else `api_key`) and the result's `scale_events` lists the events seen (None if the server has
    no admin API or refuses the key). Never raises for server or network failures: they are in
    the records. `transport` replaces the network (tests).
    """
    stop = stop or asyncio.Event()
    finished = asyncio.Event()  # ends the scale-event watch
    progress = progress or LoadProgress(spec.duration_s)
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
    timeout = httpx.Timeout(request_timeout_s, connect=min(30.0, request_timeout_s))
    records: list[RequestRecord] = []
    tasks: list[asyncio.Task[None]] = []
    t0 = progress.t0 = time.monotonic()
    t0_wall = time.time()

    def now() -> float:
        return time.monotonic() - t0

    async def send(client: httpx.AsyncClient, record: RequestRecord, body: dict[str, Any]) -> None:
        try:
            await stream_completion(client, record, body, now)
        finally:
            if record.is_ok:
                progress.num_ok += 1
            else:
                progress.num_failed += 1
            if on_record is not None:
                on_record(record)

    async with httpx.AsyncClient(base_url=base_url, headers=headers, limits=limits, timeout=timeout,
                                 transport=transport) as client:
        watcher = None
        if watch_scale_events:
            watcher = asyncio.create_task(_watch_scale_events(client, finished, poll_interval_s, admin_key))
        for req in plan_requests(spec):
            delay = req.arrival_s - now()
            if delay > 0:
                try:
                    await asyncio.wait_for(stop.wait(), delay)
                except TimeoutError:
                    pass
            if stop.is_set():
                break
            record = RequestRecord(req.request_id, req.arrival_s, req.prompt_len, req.max_tokens, model=req.model)
            records.append(record)
            progress.num_sent += 1
            tasks.append(asyncio.create_task(send(client, record, req.body())))
        if tasks:
            _, pending = await asyncio.wait(tasks, timeout=request_timeout_s if drain_timeout_s is None else drain_timeout_s)
            for task in pending:
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
        finished.set()
        events = await watcher if watcher is not None else None
    for record in records:
        if record.finished_s is None and record.error is None:
            record.error = "not finished when the load stopped"
    result = LoadResult(records, t0_wall)
    if events is not None:
        result.scale_events = events_on_axis(events, t0_wall)
    return result


async def _watch_scale_events(
    client: httpx.AsyncClient, stop: asyncio.Event, interval_s: float, admin_key: str | None
) -> list[dict[str, Any]] | None:
    """Scale events seen on `GET /admin/status` until `stop`, re-read at the end for their final
    figures; None when the server answers 401/403/404 (no admin API, or no rights) or its status
    has no scale events at all (a server that does not scale: `serve --single`).

    Status shows the running event and the latest events (`scale_events`), so none is missed."""
    headers = {"Authorization": f"Bearer {admin_key}"} if admin_key else None
    seen: dict[str, dict[str, Any]] = {}
    while True:
        try:
            r = await client.get("/admin/status", headers=headers)
            if r.status_code in ADMIN_UNSUPPORTED:
                logger.info("no scale events: GET /admin/status answered %d", r.status_code)
                return None
            if r.status_code == 200:
                status = r.json()
                if "scale_events" not in status and "scale_event" not in status:
                    logger.info("no scale events: this server's /admin/status has none")
                    return None
                listed = status.get("scale_events") or []
                for e in [status.get("scale_event"), *listed]:
                    if isinstance(e, dict) and "event_id" in e:
                        seen[e["event_id"]] = e
        except (httpx.HTTPError, ValueError) as exc:
            logger.debug("GET /admin/status failed: %r", exc)
        if stop.is_set():
            break
        try:
            await asyncio.wait_for(stop.wait(), interval_s)
        except TimeoutError:
            pass
    for event_id, e in seen.items():
        if e.get("state") == "running" or e.get("finished_at") is None:
            try:
                r = await client.get(f"/admin/scale/{event_id}", headers=headers)
                if r.status_code == 200:
                    seen[event_id] = r.json()
            except (httpx.HTTPError, ValueError) as exc:
                logger.debug("GET /admin/scale/%s failed: %r", event_id, exc)
    return list(seen.values())


def install_stop_on_sigint(stop: asyncio.Event) -> None:
    """The first Ctrl-C stops sending (the run drains and reports); a second one interrupts."""
    loop = asyncio.get_running_loop()

    def handler() -> None:
        stop.set()
        loop.remove_signal_handler(signal.SIGINT)

    try:
        loop.add_signal_handler(signal.SIGINT, handler)
    except (NotImplementedError, RuntimeError):  # not the main thread, or no signals here
        pass

