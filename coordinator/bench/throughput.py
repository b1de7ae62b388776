"""Saturated serving throughput of the elastic server at fixed dps, per engine backend.

    python -m coordinator.bench.throughput --backend vllm --model models/small-qwen3-moe \\
        --dtype bfloat16 --dps 1,2 --concurrency 32 --json

Closed loop: `--concurrency` clients each stream one greedy completion after another (random
token-id prompts, `ignore_eos`, seeded), so the server is saturated without the queue overflows
(503s) an open-loop rate beyond capacity would cause. Per dp (reached with an elastic scale, the
standby pool then left to settle): `--warmup-s` of load, then `--duration-s` measured: output
tokens/s (the tokens of the chunks received in the window), completed and failed requests,
TTFT and TPOT medians of the requests that started and ended in it. Running it once per backend
on the same arguments compares the engines on one workload and dp
(`coordinator.bench.backend_compare --throughput`).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import secrets
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import httpx

from coordinator.bench.loadgen import RequestRecord, stream_completion
from coordinator.bench.report_output import claim_stdout, progress_printer
from coordinator.bench.server_admin import ensure_dp, wait_standby
from elasticmoe.utils.ports import free_port

_progress = progress_printer("throughput")


async def _client(client: httpx.AsyncClient, model: str, args: argparse.Namespace, seed: int,
                  records: list[RequestRecord], now: Any, stop: asyncio.Event) -> None:
    rng = random.Random(seed)
    i = 0
    while not stop.is_set():
        prompt = [rng.randrange(5, args.vocab_size) for _ in range(args.prompt_len)]
        record = RequestRecord(seed * 1_000_000 + i, now(), args.prompt_len, args.max_tokens)
        body = {"model": model, "prompt": prompt, "max_tokens": args.max_tokens, "temperature": 0,
                "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
        await stream_completion(client, record, body, now)
        records.append(record)
        i += 1


def _clock() -> Any:
    """Seconds since this call, as a function."""
    t0 = time.monotonic()
    return lambda: time.monotonic() - t0


def requests_inside(records: list[RequestRecord], start_s: float, end_s: float) -> list[RequestRecord]:
    """The successful requests that started and finished in the window [start_s, end_s)."""
    return [r for r in records if r.is_ok and start_s <= r.arrival_s and (r.finished_s or 0) < end_s]


def tokens_per_chunk(record: RequestRecord) -> float:
    """Output tokens per streamed chunk of a successful request; 1 otherwise."""
    if record.is_ok and record.token_times_s and record.num_tokens:
        return record.num_tokens / len(record.token_times_s)
    return 1.0


def window_stats(records: list[RequestRecord], start_s: float, end_s: float) -> dict[str, Any]:
    """Figures of the window [start_s, end_s) (times on the records' axis)."""
    # A chunk may carry several tokens (a server merges the deltas of a client that lags behind), so
    # each request's chunks in the window count its own tokens per chunk (1 for a failed one).
    tokens = sum(sum(1 for t in r.token_times_s if start_s <= t < end_s) * tokens_per_chunk(r) for r in records)
    inside = requests_inside(records, start_s, end_s)
    ttft = [r.ttft_s for r in inside if r.ttft_s is not None]
    tpot = [r.tpot_s for r in inside if r.tpot_s is not None]
    return {
        "output_tok_s": tokens / (end_s - start_s),
        "completed": sum(1 for r in records if r.is_ok and start_s <= (r.finished_s or -1) < end_s),
        "failed": sum(1 for r in records if not r.is_ok and start_s <= r.arrival_s < end_s),
        "ttft_s_p50": statistics.median(ttft) if ttft else None,
        "tpot_s_p50": statistics.median(tpot) if tpot else None,
    }


async def closed_loop(client: httpx.AsyncClient, model: str, args: argparse.Namespace) -> list[RequestRecord]:
    """`args.concurrency` clients stream back to back for `args.warmup_s + args.duration_s`, then finish
    the requests they have in flight. Times on the returned records are seconds since the loop began.
    Uses `args.seed`, `args.prompt_len`, `args.max_tokens` and `args.vocab_size`."""
    records: list[RequestRecord] = []
    stop = asyncio.Event()
    now = _clock()
    tasks = [asyncio.create_task(_client(client, model, args, args.seed + c, records, now, stop))
             for c in range(args.concurrency)]
    await asyncio.sleep(args.warmup_s + args.duration_s)
    stop.set()
    await asyncio.gather(*tasks)
    return records


async def measure_dps(url: str, args: argparse.Namespace) -> list[dict[str, Any]]:
    out = []
    async with httpx.AsyncClient(base_url=url, timeout=300.0,
                                 limits=httpx.Limits(max_connections=args.concurrency + 8)) as client:
        model = (await client.get("/v1/models")).json()["data"][0]["id"]
        for dp in args.dps:
            await ensure_dp(client, dp, 600.0, _progress)
            await wait_standby(client, 600.0, _progress)
            records = await closed_loop(client, model, args)
            stats = window_stats(records, args.warmup_s, args.warmup_s + args.duration_s)
            _progress(f"dp {dp}: {stats['output_tok_s']:.1f} output tok/s, {stats['completed']} completed, "
                      f"{stats['failed']} failed")
            out.append({"dp": dp, **stats})
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m coordinator.bench.throughput", description=__doc__.splitlines()[0])
    p.add_argument("--backend", default="native", choices=["native", "vllm"])
    p.add_argument("--model", required=True, metavar="DIR")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--dps", default="1,2", help="dps to measure, in order (comma-separated)")
    p.add_argument("--concurrency", type=int, default=32, help="closed-loop clients")
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--warmup-s", type=float, default=10.0)
    p.add_argument("--duration-s", type=float, default=20.0)
    p.add_argument("--device-memory-gb", type=float, default=1.0)
    p.add_argument("--kv-cache-gb", type=float, default=1 / 16)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true", help="print the results as one JSON document on stdout")
    p.add_argument("--out", default=None, metavar="FILE", help="also write the JSON document to FILE")
    args = p.parse_args(argv)
    args.dps = [int(d) for d in args.dps.split(",")]
    args.vocab_size = int(json.loads((Path(args.model) / "config.json").read_text())["vocab_size"])
    json_out = claim_stdout()

    from coordinator.config import CoordinatorConfig
    from coordinator.launch import start_elastic

    config = CoordinatorConfig(
        model_dir=args.model, num_devices=max(args.dps), dp=args.dps[0], dtype=args.dtype, backend=args.backend,
        device_memory_bytes=int(args.device_memory_gb * (1 << 30)), kv_bytes_per_device=int(args.kv_cache_gb * (1 << 30)),
        max_queued=max(256, 4 * args.concurrency), shm_prefix=f"emoethroughput{secrets.token_hex(4)}",
    )
    _progress(f"starting the elastic server: {args.backend}, {args.model}, dps {args.dps}, {args.dtype}")
    server = start_elastic(config, port=free_port(), ray_init_kwargs={"num_cpus": 2, "log_to_driver": False})
    try:
        results = asyncio.run(measure_dps(server.url, args))
    finally:
        server.shutdown()
    doc = {"benchmark": "coordinator.bench.throughput",
           "config": {k: getattr(args, k) for k in ("backend", "model", "dtype", "dps", "concurrency", "prompt_len",
                                                    "max_tokens", "warmup_s", "duration_s", "seed")},
           "results": results}
    text = json.dumps(doc, indent=2)
    if args.out:
        Path(args.out).write_text(text + "\n")
    if args.json:
        print(text, file=json_out, flush=True)
    else:
        print("\n".join(f"dp {r['dp']}: {r['output_tok_s']:.1f} tok/s" for r in results), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
