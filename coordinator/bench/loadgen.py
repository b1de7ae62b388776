"""Seeded Poisson load over HTTP: streamed completions with a timestamp for every token.

`PoissonLoad.run(stop)` sends requests at the arrival times of a (possibly
non-homogeneous) Poisson process until `stop` is set, then waits for the requests
in flight to finish. Every request becomes a `RequestRecord`: its arrival, HTTP
status, the arrival time of each streamed chunk, its token count and any error.

Times are seconds on the monotonic clock relative to the load's start
(`LoadResult.t0_wall` is the wall-clock time of t=0, so `to_rel(unix_time)` aligns
the server's `started_at` / `finished_at` with the records). Prompts are random
token ids (exact lengths, no tokenizer); lengths come from small uniform ranges.
The arrival times and request shapes depend only on the seed.

`stream_completion` is the sender on its own, for other schedules (`coordinator.bench.load`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import random
import time
from collections.abc import Callable
from typing import Any

import httpx

from elasticmoe.entrypoints.openai.choices import ADAPTER_STATE_HEADER

logger = logging.getLogger(__name__)

RateFn = Callable[[float], float]  # requests/s at time t (seconds since the load started)


@dataclasses.dataclass
class RequestRecord:
    """One request as the client saw it. `token_times_s` holds one entry per streamed chunk."""

    request_id: int
    arrival_s: float
    prompt_len: int
    max_tokens: int
    status: int | None = None
    token_times_s: list[float] = dataclasses.field(default_factory=list)
    num_tokens: int = 0  # from the final usage chunk, else the number of chunks
    finished_s: float | None = None
    error: str | None = None
    model: str | None = None  # the request's `model`: the base model or an adapter
    text: str = ""  # what was streamed (chaos runs compare it with an undisturbed run)
    adapter_state: str | None = None  # the server's x-elasticmoe-adapter-state header: resident / swapped

    @property
    def is_ok(self) -> bool:
        """200, streamed to `[DONE]` without an error chunk."""
        return self.status == 200 and self.error is None and self.finished_s is not None

    @property
    def first_token_s(self) -> float | None:
        return self.token_times_s[0] if self.token_times_s else None

    @property
    def ttft_s(self) -> float | None:
        first = self.first_token_s
        return None if first is None else first - self.arrival_s

    @property
    def tpot_s(self) -> float | None:
        """Mean time per output token after the first (None with fewer than two tokens)."""
        if len(self.token_times_s) < 2 or self.num_tokens < 2:
            return None
        return (self.token_times_s[-1] - self.token_times_s[0]) / (self.num_tokens - 1)


@dataclasses.dataclass
class LoadResult:
    records: list[RequestRecord]
    t0_wall: float  # unix time of t=0
    # The server's scale events seen during the load, with `start_s` / `end_s` on the records'
    # axis (`coordinator.bench.load`); None when not watched or the server has no admin API.
    scale_events: list[dict[str, Any]] | None = None

    def to_rel(self, unix_time: float) -> float:
        """A server wall-clock timestamp on the records' time axis."""
        return unix_time - self.t0_wall


@dataclasses.dataclass(frozen=True, slots=True)
class Workload:
    """Request shapes: lengths drawn uniformly from the inclusive ranges."""

    prompt_len: tuple[int, int] = (32, 32)
    max_tokens: tuple[int, int] = (32, 32)
    vocab_size: int = 512
    first_token_id: int = 5  # skip special ids at the start of the vocabulary

    def __post_init__(self) -> None:
        for name, (lo, hi) in (("prompt_len", self.prompt_len), ("max_tokens", self.max_tokens)):
            if not 1 <= lo <= hi:
                raise ValueError(f"{name}: need 1 <= min <= max, got {lo}-{hi}")
        if self.vocab_size <= self.first_token_id:
            raise ValueError(f"vocab_size: must exceed {self.first_token_id}, got {self.vocab_size}")


def parse_sse_line(line: str) -> dict | None:
    """The JSON payload of a `data:` line; None for other lines and for `[DONE]`."""
    if not line.startswith("data: ") or line == "data: [DONE]":
        return None
    return json.loads(line[len("data: ") :])


class PoissonLoad:
    """Streams completions to `base_url` at Poisson arrival times until stopped.

    `rps` is a rate function of time (or a constant); `rps_max` bounds it (needed
    only for a function). One seeded RNG draws the arrivals and the request shapes,
    so two runs with the same seed send the same requests at the same offsets.
    """

    def __init__(
        self,
        base_url: str,
        model: str,
        rps: RateFn | float,
        workload: Workload,
        seed: int = 0,
        rps_max: float | None = None,
        request_timeout_s: float = 300.0,
        drain_timeout_s: float = 120.0,
        on_record: Callable[[RequestRecord], None] | None = None,
    ) -> None:
        if callable(rps):
            if rps_max is None:
                raise ValueError("rps_max: required when rps is a function")
            self.rps, self.rps_max = rps, float(rps_max)
        else:
            rate = float(rps)
            self.rps, self.rps_max = (lambda t: rate), rate
        self.base_url = base_url
        self.model = model
        self.workload = workload
        self.rng = random.Random(seed)
        self.request_timeout_s = request_timeout_s
        self.drain_timeout_s = drain_timeout_s
        self.on_record = on_record
        self.records: list[RequestRecord] = []
        self._t0 = 0.0

    def now(self) -> float:
        """Seconds since the load started (monotonic)."""
        return time.monotonic() - self._t0

    def _next_gap(self, t: float) -> float:
        """Time to the next accepted arrival after `t` (thinning against `rps_max`)."""
        gap = 0.0
        while True:
            gap += self.rng.expovariate(self.rps_max) if self.rps_max > 0 else float("inf")
            if gap == float("inf") or self.rng.random() * self.rps_max < self.rps(t + gap):
                return gap

    def _make_request(self, request_id: int, arrival_s: float) -> tuple[RequestRecord, dict]:
        w = self.workload
        prompt_len = self.rng.randint(*w.prompt_len)
        max_tokens = self.rng.randint(*w.max_tokens)
        prompt = [self.rng.randrange(w.first_token_id, w.vocab_size) for _ in range(prompt_len)]
        body = {
            "model": self.model,
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        return RequestRecord(request_id, arrival_s, prompt_len, max_tokens, model=self.model), body

    async def run(self, stop: asyncio.Event) -> LoadResult:
        """Send requests until `stop` is set, then wait (up to `drain_timeout_s`) for those in flight."""
        self._t0 = time.monotonic()
        t0_wall = time.time()
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
        timeout = httpx.Timeout(self.request_timeout_s, connect=30.0)
        tasks: list[asyncio.Task[None]] = []
        async with httpx.AsyncClient(base_url=self.base_url, limits=limits, timeout=timeout) as client:
            next_s = self._next_gap(0.0)
            while not stop.is_set():
                delay = next_s - self.now()
                if delay > 0:
                    try:
                        await asyncio.wait_for(stop.wait(), delay)
                        break  # stopped before the next arrival
                    except TimeoutError:
                        pass
                record, body = self._make_request(len(self.records), next_s)
                self.records.append(record)
                tasks.append(asyncio.create_task(self._send(client, record, body)))
                next_s += self._next_gap(next_s)
            if tasks:
                _, pending = await asyncio.wait(tasks, timeout=self.drain_timeout_s)
                for task in pending:
                    task.cancel()
                await asyncio.gather(*pending, return_exceptions=True)
        for record in self.records:
            if record.finished_s is None and record.error is None:
                record.error = "not finished when the load stopped"
        return LoadResult(self.records, t0_wall)

    async def _send(self, client: httpx.AsyncClient, record: RequestRecord, body: dict) -> None:
        try:
            await stream_completion(client, record, body, self.now)
        finally:
            if self.on_record is not None and (record.finished_s is not None or record.error is not None):
                self.on_record(record)


async def stream_completion(
    client: httpx.AsyncClient, record: RequestRecord, body: dict, now: Callable[[], float]
) -> None:
    """POST `body` (a streaming request) to `/v1/completions` and fill in `record` as chunks arrive.

    `now()` gives the records' time axis. Transport errors, non-200 replies, error chunks and
    streams cut short end up in `record.error`; only cancellation propagates.
    """
    try:
        async with client.stream("POST", "/v1/completions", json=body) as response:
            record.status = response.status_code
            record.adapter_state = response.headers.get(ADAPTER_STATE_HEADER)
            if response.status_code != 200:
                record.error = (await response.aread()).decode(errors="replace")[:200]
                return
            async for line in response.aiter_lines():
                if line == "data: [DONE]":
                    record.finished_s = now()
                    break
                chunk = parse_sse_line(line)
                if chunk is None:
                    continue
                if "error" in chunk:
                    record.error = str(chunk["error"])[:200]
                    return
                if chunk.get("choices"):
                    record.token_times_s.append(now())
                    record.text += chunk["choices"][0].get("text") or ""
                if chunk.get("usage"):
                    record.num_tokens = int(chunk["usage"]["completion_tokens"])
            if record.finished_s is None:
                record.error = "stream ended without [DONE]"
            elif record.num_tokens == 0:
                record.num_tokens = len(record.token_times_s)
    except asyncio.CancelledError:
        record.error = "cancelled"
        raise
    except (httpx.HTTPError, ValueError) as exc:  # ValueError: a chunk that is not JSON
        record.error = f"{type(exc).__name__}: {exc}"[:200]
