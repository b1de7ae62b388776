"""Serving comparison: one closed-loop streaming load against any OpenAI-compatible server.

    python -m coordinator.bench.serving --url http://127.0.0.1:8000 --model models/small-qwen3-moe \\
        --label single --out bench-out/serving/single.json
    python -m coordinator.bench.serving --compare bench-out/serving/{single,elastic,vllm}.json

Measure (the default): `--concurrency` clients each stream one completion after another to
`--url`/v1/completions (the closed loop of `coordinator.bench.throughput`: prompts of
`--prompt-len` random token ids, seeded per client, greedy, `ignore_eos`, exactly `--max-tokens`
tokens each), `--warmup-s` of load, then `--duration-s` measured. The server is only spoken to
over HTTP, so ElasticMoE's single and elastic servers and vLLM's OpenAI server take the same
requests; an elastic server (one with /admin/status) is first left to finish booting its standby
instances. Figures of the measured window: output tokens/s (the tokens streamed in it),
completed requests (finished in it), failed requests (started in it and failed: an HTTP error,
an error chunk, a stream cut short), and TTFT and TPOT p50/p99 of the successful requests that
started and finished in it (TPOT = (last chunk - first chunk) / (tokens - 1)). Both are times of
streamed chunks: a server that sends a chunk only once the text grows (ours, while the tokens are
bytes of an unfinished UTF-8 character) shows its tokens late; `tokens_per_chunk_mean` tells.

Compare (`--compare FILE ...`): one table from the JSON documents of several measurements, a row
per label (the medians of its runs when a label was measured more than once), and the ratios
`--ratios` names (default elastic/single and elastic/vllm: output tok/s, TTFT p50 and TPOT p50 of
the first label over the second's). It only reads the files, so any run can be compared later.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import httpx

from coordinator.bench.loadgen import RequestRecord
from coordinator.bench.report_output import progress_printer
from coordinator.bench.server_admin import wait_standby
from coordinator.bench.throughput import closed_loop, requests_inside, tokens_per_chunk, window_stats

DEFAULT_RATIOS = "elastic/single,elastic/vllm"
MAX_ERRORS_KEPT = 5


def percentile(values: list[float], q: float) -> float | None:
    """The q-th percentile (q in 1..99), linear between closest ranks (numpy's default); None if empty."""
    if not values:
        return None
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=100, method="inclusive")[round(q) - 1]


def summarize(records: list[RequestRecord], start_s: float, end_s: float) -> dict[str, Any]:
    """The figures of the window [start_s, end_s): throughput and counts as
    `coordinator.bench.throughput.window_stats` reports them, latencies in ms at p50 and p99, and
    the gaps between a stream's chunks (ITL) at p99 and their longest: a stall of the server (a
    garbage collection, a swap) shows there, while TPOT averages it over the request's tokens."""
    stats = window_stats(records, start_s, end_s)
    inside = requests_inside(records, start_s, end_s)
    ttft_ms = [r.ttft_s * 1e3 for r in inside if r.ttft_s is not None]
    tpot_ms = [r.tpot_s * 1e3 for r in inside if r.tpot_s is not None]
    itl_ms = [(b - a) * 1e3 for r in inside for a, b in itertools.pairwise(r.token_times_s)]
    return {
        "output_tok_s": stats["output_tok_s"],
        "completed": stats["completed"],
        "failed": stats["failed"],
        "num_timed": len(inside),
        # > 1 where the server merged the deltas of a client that fell behind (the client shares the cores)
        "tokens_per_chunk_mean": statistics.fmean(map(tokens_per_chunk, inside)) if inside else None,
        "ttft_ms_p50": percentile(ttft_ms, 50),
        "ttft_ms_p99": percentile(ttft_ms, 99),
        "tpot_ms_p50": percentile(tpot_ms, 50),
        "tpot_ms_p99": percentile(tpot_ms, 99),
        "itl_ms_p99": percentile(itl_ms, 99),
        "itl_ms_max": max(itl_ms, default=None),
    }


def error_samples(records: list[RequestRecord]) -> list[str]:
    """Up to `MAX_ERRORS_KEPT` distinct errors of failed requests, as status and message."""
    seen: list[str] = []
    for r in records:
        if r.is_ok or r.error == "cancelled":
            continue
        text = f"{r.status}: {r.error}"
        if text not in seen:
            seen.append(text)
            if len(seen) == MAX_ERRORS_KEPT:
                break
    return seen


# ---- the comparison table ------------------------------------------------------------------------


def _fmt(value: float | int | None, digits: int = 1) -> str:
    if value is None:
        return "-"
    return str(value) if isinstance(value, int) else f"{value:.{digits}f}"


def parse_ratios(text: str) -> list[tuple[str, str]]:
    """"elastic/single,elastic/vllm" -> [("elastic", "single"), ("elastic", "vllm")]."""
    pairs = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        num, sep, den = part.partition("/")
        if not sep or not num or not den:
            raise ValueError(f"--ratios: expected LABEL/LABEL, got {part!r}")
        pairs.append((num, den))
    return pairs


FIGURES = ("output_tok_s", "completed", "failed", "ttft_ms_p50", "ttft_ms_p99", "tpot_ms_p50", "tpot_ms_p99",
           "itl_ms_p99", "itl_ms_max")


def group_runs(docs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One entry per label (in first-seen order): the median of each figure over its runs, the
    throughput of every run, and the lowest and highest load average seen."""
    by_label: dict[str, list[dict[str, Any]]] = {}
    for d in docs:
        by_label.setdefault(d["label"], []).append(d)
    groups = []
    for label, runs in by_label.items():
        result: dict[str, Any] = {}
        for key in FIGURES:
            values = [r["result"][key] for r in runs if r["result"].get(key) is not None]
            result[key] = statistics.median(values) if values else None
        loads = [x for r in runs for x in (r.get("loadavg_1m") or []) if x is not None]
        groups.append({"label": label, "num_runs": len(runs), "result": result,
                       "output_tok_s_runs": [r["result"]["output_tok_s"] for r in runs],
                       "loadavg_1m": [min(loads), max(loads)] if loads else None})
    return groups


def ratio_rows(docs: list[dict[str, Any]], pairs: list[tuple[str, str]]) -> list[dict[str, Any]]:
    """For each (a, b) with both labels measured: a's (median) figure over b's (throughput: higher
    is better; latencies: lower is better)."""
    by_label = {g["label"]: g["result"] for g in group_runs(docs)}
    rows = []
    for num, den in pairs:
        a, b = by_label.get(num), by_label.get(den)
        if a is None or b is None:
            continue
        row: dict[str, Any] = {"ratio": f"{num}/{den}"}
        for key in ("output_tok_s", "ttft_ms_p50", "tpot_ms_p50"):
            row[key] = a[key] / b[key] if a.get(key) and b.get(key) else None
        rows.append(row)
    return rows


def format_table(docs: list[dict[str, Any]], pairs: list[tuple[str, str]]) -> str:
    """A Markdown table, a row per label (medians over its runs, each run's throughput in brackets
    when there are several), then the ratios table."""
    lines = ["| server | output tok/s | completed | failed | TTFT p50 / p99 (ms) | TPOT p50 / p99 (ms) "
             "| ITL p99 / max (ms) | load 1m |",
             "|---|---|---|---|---|---|---|---|"]
    for g in group_runs(docs):
        r = g["result"]
        load = g["loadavg_1m"] or [None, None]
        tok_s = _fmt(r["output_tok_s"])
        if g["num_runs"] > 1:
            tok_s += " (" + ", ".join(f"{x:.0f}" for x in g["output_tok_s_runs"]) + ")"
        lines.append(f"| {g['label']} | {tok_s} | {_fmt(r['completed'], 0)} | {_fmt(r['failed'], 0)} "
                     f"| {_fmt(r['ttft_ms_p50'], 0)} / {_fmt(r['ttft_ms_p99'], 0)} "
                     f"| {_fmt(r['tpot_ms_p50'])} / {_fmt(r['tpot_ms_p99'])} "
                     f"| {_fmt(r.get('itl_ms_p99'))} / {_fmt(r.get('itl_ms_max'))} "
                     f"| {_fmt(load[0])}-{_fmt(load[1])} |")
    rows = ratio_rows(docs, pairs)
    if rows:
        lines += ["", "| ratio (medians) | output tok/s | TTFT p50 | TPOT p50 |", "|---|---|---|---|"]
        lines += [f"| {row['ratio']} | {_fmt(row['output_tok_s'], 2)} | {_fmt(row['ttft_ms_p50'], 2)} "
                  f"| {_fmt(row['tpot_ms_p50'], 2)} |" for row in rows]
    return "\n".join(lines)


# ---- measuring -----------------------------------------------------------------------------------


_progress = progress_printer("serving")


async def _served_model(client: httpx.AsyncClient, name: str | None) -> str:
    models = [m["id"] for m in (await client.get("/v1/models")).raise_for_status().json()["data"]]
    if name is None:
        return str(models[0])
    if name not in models:
        raise SystemExit(f"error: --served-model: {name!r} is not served (the server lists {models})")
    return name


async def _settle(client: httpx.AsyncClient) -> None:
    """An elastic server: wait for its standby instances to finish booting (they take the cores)."""
    status = await client.get("/admin/status")
    if status.status_code == 200 and "standby" in status.json():
        _progress("elastic server: waiting for its standby instances to be ready")
        await wait_standby(client, 600.0, _progress)


async def measure(args: argparse.Namespace) -> dict[str, Any]:
    limits = httpx.Limits(max_connections=args.concurrency + 8)
    async with httpx.AsyncClient(base_url=args.url, timeout=300.0, limits=limits) as client:
        model = await _served_model(client, args.served_model)
        await _settle(client)
        _progress(f"{args.label}: {args.concurrency} clients, {args.prompt_len} in / {args.max_tokens} out, "
                  f"{args.warmup_s:g} s warm-up + {args.duration_s:g} s measured")
        load_start = os.getloadavg()[0]
        started_at = time.strftime("%Y-%m-%dT%H:%M:%S%z")
        records = await closed_loop(client, model, args)
        load_end = os.getloadavg()[0]
    result = summarize(records, args.warmup_s, args.warmup_s + args.duration_s)
    return {
        "benchmark": "coordinator.bench.serving",
        "label": args.label,
        "url": args.url,
        "served_model": model,
        "started_at": started_at,
        "loadavg_1m": [load_start, load_end],
        "config": {k: getattr(args, k) for k in ("concurrency", "prompt_len", "max_tokens", "warmup_s",
                                                 "duration_s", "seed", "vocab_size")},
        "result": result,
        "errors": error_samples(records),
    }


def _vocab_size(args: argparse.Namespace, p: argparse.ArgumentParser) -> int:
    if args.vocab_size is not None:
        return int(args.vocab_size)
    if args.model is None:
        p.error("--model DIR or --vocab-size N is needed (the prompts are random token ids)")
    config = Path(args.model) / "config.json"
    if not config.is_file():
        p.error(f"--model: {args.model} has no config.json")
    return int(json.loads(config.read_text())["vocab_size"])


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m coordinator.bench.serving", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", default="http://127.0.0.1:8000", help="base URL of the server (default %(default)s)")
    p.add_argument("--served-model", default=None, metavar="NAME",
                   help="the `model` of the requests (default: the first model the server lists)")
    p.add_argument("--model", default=None, metavar="DIR", help="the checkpoint served: its vocab_size bounds "
                   "the prompts' token ids")
    p.add_argument("--vocab-size", type=int, default=None, metavar="N", help="instead of --model")
    p.add_argument("--concurrency", type=int, default=64, help="closed-loop clients (default %(default)s)")
    p.add_argument("--prompt-len", type=int, default=128, help="prompt tokens per request (default %(default)s)")
    p.add_argument("--max-tokens", type=int, default=64, help="output tokens per request (default %(default)s)")
    p.add_argument("--warmup-s", type=float, default=10.0, help="load before the window (default %(default)s)")
    p.add_argument("--duration-s", type=float, default=30.0, help="measured window (default %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="client c draws its prompts with seed + c")
    p.add_argument("--label", default="server", help="name of this measurement in the JSON and the table "
                   "(the compare mode's ratios refer to labels: single, elastic, vllm)")
    p.add_argument("--json", action="store_true", help="print the results as one JSON document on stdout")
    p.add_argument("--out", default=None, metavar="FILE", help="also write the JSON document to FILE")
    p.add_argument("--compare", nargs="+", default=None, metavar="FILE",
                   help="instead of measuring: one table (stderr) from these JSON documents, with --ratios")
    p.add_argument("--ratios", default=DEFAULT_RATIOS, metavar="A/B,...",
                   help="label pairs to divide in the compare table (default %(default)s)")
    return p


def main(argv: list[str] | None = None) -> int:
    p = build_parser()
    args = p.parse_args(argv)
    try:
        pairs = parse_ratios(args.ratios)
    except ValueError as exc:
        p.error(str(exc))
    if args.compare is not None:
        docs = [json.loads(Path(f).read_text()) for f in args.compare]
        table = format_table(docs, pairs)
        doc: dict[str, Any] = {"benchmark": "coordinator.bench.serving compare", "runs": docs,
                               "medians": group_runs(docs), "ratios": ratio_rows(docs, pairs), "table": table}
        print(table, file=sys.stderr if args.json else sys.stdout, flush=True)
    else:
        if min(args.concurrency, args.prompt_len, args.max_tokens) < 1 or args.duration_s <= 0 or args.warmup_s < 0:
            p.error("--concurrency, --prompt-len, --max-tokens and --duration-s must be positive")
        args.vocab_size = _vocab_size(args, p)
        doc = asyncio.run(measure(args))
        table = format_table([doc], [])
        print(table, file=sys.stderr, flush=True)
        for error in doc["errors"]:
            _progress(f"failed request: {error}")
    text = json.dumps(doc, indent=2)
    if args.out:
        Path(args.out).write_text(text + "\n")
    if args.json:
        print(text, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
