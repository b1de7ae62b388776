"""Per-token cost of moving a rank's outputs to the ingress, by transport and message shape.

    python -m imm.bench_stream --json [--steps 200] [--batches 1 16 64]

A producer actor emits what a rank emits per engine step for `batch` running requests
(prompt of 128 tokens, one new token each), with no compute, so the time per token is pure
transport, measured at an asyncio consumer (as the ingress is):

- `ray_per_request_full`: one Ray streaming generator per request, each item a full
  `RequestOutput` (prompt, every output id and the text so far beside the delta): what
  streams carried before deltas;
- `ray_per_request_delta`: one Ray stream per request, each item an `OutputDelta`;
- `ray_batched_delta`: one Ray stream per rank, each item the step's deltas of every request
  (what the ingress uses: `imm.rank_streams`);
- `zmq_batched_delta`: the same batches over a ZMQ PUSH -> PULL socket (pickled), if pyzmq
  is installed (`pip install pyzmq`).

Prints medians of `--repeats` runs (microseconds per token) and the bytes per token each
message shape puts on the wire. A batch of 1 is a lone request.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import pickle
import socket
import statistics
import time
from collections.abc import AsyncGenerator
from typing import Any

import ray

from elasticmoe.outputs import OutputDelta, RequestOutput
from hmm.local_ray import init_local_ray

PROMPT = list(range(128))


def _full(request_id: str, step: int) -> RequestOutput:
    return RequestOutput(request_id, PROMPT, [step], " tok", list(range(step + 1)), " tok" * (step + 1))


def _delta(request_id: str, step: int) -> OutputDelta:
    return OutputDelta(request_id, [step], " tok")


@ray.remote(num_cpus=0)
class _Producer:
    @ray.method(num_returns="streaming")  # type: ignore[call-arg]
    async def per_request(self, request_id: str, steps: int, full: bool) -> AsyncGenerator[Any, None]:
        for step in range(steps):
            yield _full(request_id, step) if full else _delta(request_id, step)
            await asyncio.sleep(0)  # the other requests' streams interleave, as in a real step

    @ray.method(num_returns="streaming")  # type: ignore[call-arg]
    async def batched(self, steps: int, batch: int) -> AsyncGenerator[list[OutputDelta], None]:
        for step in range(steps):
            yield [_delta(f"r{b}", step) for b in range(batch)]

    def push(self, address: str, steps: int, batch: int) -> None:
        import zmq

        sock: Any = zmq.Context.instance().socket(zmq.PUSH)
        sock.connect(address)
        for step in range(steps):
            sock.send(pickle.dumps([_delta(f"r{b}", step) for b in range(batch)], protocol=5))
        sock.send(b"")
        sock.close(linger=5000)


async def _per_request(producer: Any, steps: int, batch: int, full: bool) -> float:
    async def one(r: int) -> None:
        async for ref in producer.per_request.remote(f"r{r}", steps, full):
            await ref

    t0 = time.perf_counter()
    await asyncio.gather(*(one(r) for r in range(batch)))
    return (time.perf_counter() - t0) / (steps * batch)


async def _batched(producer: Any, steps: int, batch: int) -> float:
    t0 = time.perf_counter()
    async for ref in producer.batched.remote(steps, batch):
        await ref
    return (time.perf_counter() - t0) / (steps * batch)


async def _zmq(producer: Any, steps: int, batch: int) -> float:
    import zmq
    import zmq.asyncio

    sock: Any = zmq.asyncio.Context.instance().socket(zmq.PULL)
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    sock.bind(f"tcp://127.0.0.1:{port}")
    t0 = time.perf_counter()
    done = producer.push.remote(f"tcp://127.0.0.1:{port}", steps, batch)
    while msg := await sock.recv():
        pickle.loads(msg)
    elapsed = time.perf_counter() - t0
    await done
    sock.close()
    return elapsed / (steps * batch)


def _wire_bytes(steps: int) -> dict[str, float]:
    """Pickled bytes per token of each shape, averaged over a request of `steps` tokens."""
    full = sum(len(pickle.dumps(_full("r0", s), protocol=5)) for s in range(steps)) / steps
    delta = sum(len(pickle.dumps(_delta("r0", s), protocol=5)) for s in range(steps)) / steps
    return {"full_bytes_per_token": round(full, 1), "delta_bytes_per_token": round(delta, 1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=200, help="engine steps (tokens per request)")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64], help="requests per step")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", action="store_true", help="(the output is JSON anyway)")
    args = ap.parse_args()
    try:
        import zmq  # noqa: F401

        has_zmq = True
    except ImportError:
        has_zmq = False
    init_local_ray(num_cpus=2, log_to_driver=False)
    try:
        producer = _Producer.remote()  # type: ignore[attr-defined]
        asyncio.run(_per_request(producer, 20, 2, True))  # warm-up
        result: dict[str, Any] = {"steps": args.steps, **_wire_bytes(args.steps)}
        for batch in args.batches:
            runs: dict[str, list[float]] = {"ray_per_request_full": [], "ray_per_request_delta": [],
                                            "ray_batched_delta": [], "zmq_batched_delta": []}
            for _ in range(args.repeats):  # interleaved, so load changes hit every transport alike
                runs["ray_per_request_full"].append(asyncio.run(_per_request(producer, args.steps, batch, True)))
                runs["ray_per_request_delta"].append(asyncio.run(_per_request(producer, args.steps, batch, False)))
                runs["ray_batched_delta"].append(asyncio.run(_batched(producer, args.steps, batch)))
                if has_zmq:
                    runs["zmq_batched_delta"].append(asyncio.run(_zmq(producer, args.steps, batch)))
            result[f"batch{batch}_us_per_token"] = {
                k: round(statistics.median(v) * 1e6, 1) if v else None for k, v in runs.items()}
        print(json.dumps(result, indent=2))
    finally:
        ray.shutdown()


if __name__ == "__main__":
    main()
