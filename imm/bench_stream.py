"""Per-token overhead of streaming `RequestOutput`s from an async Ray actor to a caller.

    python -m imm.bench_stream --tokens 2000 --streams 1 4 --json

A producer actor yields realistic one-token `RequestOutput`s with no compute, so
the time per item is pure transport: Ray streaming generator (`num_returns=
"streaming"`), consumed by a sync caller (`ray.get` per ref) and by an asyncio
caller (`await ref`), with 1 and several concurrent streams; and one stream per
rank carrying each step's outputs of 16 / 64 requests as one item. Prints medians of
`--repeats` runs as JSON. ZMQ is not installed in this environment, so it is not
compared here.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from collections.abc import AsyncGenerator

import ray

from elasticmoe.outputs import RequestOutput


@ray.remote(num_cpus=0)
class _Producer:
    @ray.method(num_returns="streaming")  # type: ignore[call-arg]
    async def generate(self, request_id: str, num_tokens: int) -> AsyncGenerator[RequestOutput, None]:
        prompt = list(range(16))
        out: list[int] = []
        for i in range(num_tokens):
            out.append(i)
            yield RequestOutput(request_id, prompt, [i], " tok", list(out), "", finished=i == num_tokens - 1)

    @ray.method(num_returns="streaming")  # type: ignore[call-arg]
    async def generate_batched(self, num_steps: int, batch: int) -> AsyncGenerator[list[RequestOutput], None]:
        """One item per engine step holding the outputs of `batch` requests (a per-rank channel)."""
        prompt = list(range(16))
        for i in range(num_steps):
            yield [RequestOutput(f"r{b}", prompt, [i], " tok", list(range(i + 1)), "") for b in range(batch)]


def _sync_run(producer: object, num_tokens: int, num_streams: int) -> float:
    t0 = time.perf_counter()
    gens = [producer.generate.remote(f"r{s}", num_tokens) for s in range(num_streams)]  # type: ignore[attr-defined]
    for gen in gens:
        for ref in gen:
            ray.get(ref)
    return (time.perf_counter() - t0) / (num_tokens * num_streams)


async def _async_run(producer: object, num_tokens: int, num_streams: int) -> float:
    async def one(s: int) -> None:
        async for ref in producer.generate.remote(f"r{s}", num_tokens):  # type: ignore[attr-defined]
            await ref

    t0 = time.perf_counter()
    await asyncio.gather(*(one(s) for s in range(num_streams)))
    return (time.perf_counter() - t0) / (num_tokens * num_streams)


def _batched_run(producer: object, num_steps: int, batch: int) -> float:
    t0 = time.perf_counter()
    for ref in producer.generate_batched.remote(num_steps, batch):  # type: ignore[attr-defined]
        ray.get(ref)
    return (time.perf_counter() - t0) / (num_steps * batch)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=2000)
    ap.add_argument("--streams", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", action="store_true", help="(default output is JSON anyway)")
    args = ap.parse_args()
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        producer = _Producer.remote()  # type: ignore[attr-defined]
        _sync_run(producer, 100, 1)  # warm-up
        result: dict[str, float] = {}
        for n in args.streams:
            sync = [_sync_run(producer, args.tokens, n) for _ in range(args.repeats)]
            asyn = [asyncio.run(_async_run(producer, args.tokens, n)) for _ in range(args.repeats)]
            result[f"ray_stream_sync_us_per_token_streams{n}"] = round(statistics.median(sync) * 1e6, 1)
            result[f"ray_stream_async_us_per_token_streams{n}"] = round(statistics.median(asyn) * 1e6, 1)
        for b in (16, 64):
            runs = [_batched_run(producer, args.tokens // 10, b) for _ in range(args.repeats)]
            result[f"ray_stream_per_step_batch{b}_us_per_token"] = round(statistics.median(runs) * 1e6, 1)
        print(json.dumps(result, indent=2))
    finally:
        ray.shutdown()


if __name__ == "__main__":
    main()
