"""Chaos benchmark: kill processes of a serving elastic server and measure what clients see.

    python -m coordinator.bench.chaos --json [--faults rank@1,rank@2,device@1,mid-scale@1,coordinator@1,ingress@1]

Starts an elastic server in-process (the tiny Qwen3-MoE by default, 3 logical devices,
float32; with `--nodes D0,D1,...` on a Ray cluster of that many nodes on this machine, each
offering that many devices, the head first; `--netns` puts each node but the head in a
network namespace of its own behind a veth pair, which needs root), records an undisturbed
run of the prompts, then for each `fault@dp`: brings the server to that dp and lets it settle
(no scale, standby pool booted), starts one greedy stream per prompt, SIGKILLs the process
the fault names once every stream produces, and reports per fault: time to detect and to
recover (server side), the longest pause any stream saw after the kill beside the longest
before it, how long `/ready` said 503, requests failed / recovered (continued on another
instance), tokens recomputed, and how many streams equal the undisturbed run. See
`coordinator.bench.chaos_faults`.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import random
import secrets
import sys
from pathlib import Path
from typing import Any

import httpx

from coordinator.bench.chaos_faults import FAULTS, FaultResult, run_fault, settle, undisturbed
from coordinator.bench.local_nodes import attached, parse_nodes, ray_nodes, run_attached
from coordinator.bench.report_output import claim_stdout, emit, progress_printer
from elasticmoe.utils.ports import free_port
from hmm.memory.lease import reap

DEFAULT_FAULTS = "rank@1,rank@2,device@1,mid-scale@1,coordinator@1,ingress@1"
_GIB = 1 << 30


_progress = progress_printer("chaos")


def parse_faults(text: str, num_devices: int) -> list[tuple[str, int]]:
    """`fault@dp,...` -> [(fault, dp)]; `ValueError` naming `--faults` otherwise."""
    out = []
    for item in text.split(","):
        fault, _, dp = item.strip().partition("@")
        if fault not in FAULTS or not dp.isdigit() or not 1 <= int(dp) <= num_devices:
            raise ValueError(f"--faults: {item!r}: want FAULT@DP with FAULT in {sorted(FAULTS)} and "
                             f"1 <= DP <= {num_devices}")
        out.append((fault, int(dp)))
    return out


def prompts(num: int, length: int, vocab_size: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab_size) for _ in range(length)] for _ in range(num)]


async def run_all(url: str, model: str, faults: list[tuple[str, int]], args: argparse.Namespace,
                  vocab_size: int, shm_prefix: str, kill_node: Any = None) -> list[FaultResult]:
    ps = prompts(args.streams, args.prompt_len, vocab_size, args.seed)
    results = []
    async with httpx.AsyncClient(base_url=url, timeout=300) as client:
        await settle(client, faults[0][1])
        reference = await undisturbed(client, model, ps, args.max_tokens)
        for fault, dp in faults:
            await settle(client, dp)
            _progress(f"{fault} at dp {dp}: {FAULTS[fault]}")
            result = await run_fault(client, fault, model, ps, reference, args.max_tokens, shm_prefix=shm_prefix,
                                     kill_node=kill_node)
            _progress(f"  {result.failed} failed, {result.identical}/{result.requests} identical, "
                      f"recovered in {_seconds(result.recover_s)}, longest stall {result.max_stall_s:.2f} s")
            results.append(result)
    return results


def _seconds(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f} s"


def format_table(results: list[dict[str, Any]]) -> str:
    lines = ["| fault | dp | detect | recover | longest stall / before | /ready 503 | failed | recovered | "
             "tokens recomputed | identical | orphaned shm |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        lines.append(
            f"| {r['fault']} | {r['dp_before']}->{r['dp_after']} | {_seconds(r['detect_s'])} | {_seconds(r['recover_s'])} | "
            f"{r['max_stall_s']:.2f} / {r['baseline_stall_s']:.2f} s | {r['ready_503_s']:.2f} s | "
            f"{r['failed']}/{r['requests']} | {r['recovered']} | {r['tokens_recomputed']} | "
            f"{r['identical']}/{r['requests']} | {r['orphaned_shm_files']} |")
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m coordinator.bench.chaos", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="models/tiny-qwen3-moe",
                   help="model directory (built with make-model --preset tiny if missing)")
    p.add_argument("--devices", type=int, default=3, help="logical devices (default 3)")
    p.add_argument("--nodes", default=None, metavar="D0,D1,...",
                   help="run on a Ray cluster of these nodes on this machine, each offering that many devices "
                   "(the head first; --devices is then their sum); needed by the node fault")
    p.add_argument("--netns", action="store_true",
                   help="with --nodes: each node but the head in its own network namespace, joined to the host "
                   "by a veth pair on a bridge (needs root), so what crosses nodes crosses a network interface")
    p.add_argument("--faults", default=DEFAULT_FAULTS, help=f"FAULT@DP list, in order (default {DEFAULT_FAULTS}); "
                   f"faults: {', '.join(f'{k} ({v})' for k, v in FAULTS.items())}")
    p.add_argument("--streams", type=int, default=6, help="concurrent streams under each fault (default 6)")
    p.add_argument("--max-tokens", type=int, default=256, help="tokens per stream (default 256)")
    p.add_argument("--prompt-len", type=int, default=16, help="prompt tokens (default 16)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true", help="print the JSON document on stdout")
    p.add_argument("--out", default=None, help="also write the JSON document to this file")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    try:
        nodes = parse_nodes(args.nodes) if args.nodes else None
        if nodes is not None:
            args.devices = sum(nodes)
        if args.netns and nodes is None:
            raise ValueError("--netns: needs --nodes")
        faults = parse_faults(args.faults, args.devices)
        if nodes is None and any(fault == "node" for fault, _ in faults):
            raise ValueError("--faults: the node fault needs --nodes")
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if not (Path(args.model) / "config.json").is_file():
        from elasticmoe.tools.make_model import make_model

        _progress(f"building {args.model} (make-model --arch qwen3_moe --preset tiny --seed 0)")
        make_model("qwen3_moe", "tiny", seed=0, out=args.model)
    cluster = attached()
    if nodes is not None and cluster is None:  # start the nodes, then measure on them as their driver
        _progress(f"starting a Ray cluster of {len(nodes)} nodes offering {list(nodes)} devices")
        with ray_nodes(head_devices=nodes[0], worker_devices=nodes[1:], netns=args.netns) as started:
            return run_attached(started, "coordinator.bench.chaos", sys.argv[1:] if argv is None else argv)
    from coordinator.config import CoordinatorConfig
    from elasticmoe.config import ModelConfig

    vocab_size = ModelConfig.from_pretrained(args.model).vocab_size
    json_out = claim_stdout()
    from coordinator.launch import start_elastic

    config = CoordinatorConfig(model_dir=args.model, num_devices=args.devices, dp=faults[0][1], dtype="float32",
                               device_memory_bytes=_GIB // 16, kv_bytes_per_device=_GIB // 128,
                               served_model_name="chaos", shm_prefix=f"emoechaos{secrets.token_hex(4)}")
    kill_node, address = (cluster.kill_node, cluster.address) if cluster is not None else (None, None)
    _progress(f"starting the elastic server: {args.model}, {args.devices} devices")
    server = start_elastic(config, port=free_port(), address=address,
                           ray_init_kwargs={"log_to_driver": False} if address else {"num_cpus": 2, "log_to_driver": False})
    try:
        results = asyncio.run(run_all(server.url, "chaos", faults, args, vocab_size, config.shm_prefix, kill_node))
    finally:
        _progress("shutting the server down")
        server.shutdown()
    left = reap(config.shm_prefix)
    doc: dict[str, Any] = {"benchmark": "coordinator.bench.chaos",
           "config": {"model": args.model, "devices": args.devices, "nodes": nodes, "netns": args.netns,
                      "faults": args.faults, "streams": args.streams,
                      "max_tokens": args.max_tokens, "prompt_len": args.prompt_len, "seed": args.seed},
           "faults": [r.to_dict() for r in results], "shm_files_left_after_shutdown": len(left)}
    emit(doc, format_table(doc["faults"]), json_out, as_json=args.json, out_path=args.out, plot_path=None,
         plot=lambda d, p: None, progress=_progress)
    return 0


if __name__ == "__main__":
    sys.exit(main())
