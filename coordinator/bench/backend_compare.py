"""Native engine vs vLLM backend: one JSON summary from `coordinator.bench.scaling` runs.

    python -m coordinator.bench.backend_compare --scaling vllm-scaling.json \\
        --throughput native=native-tp.json vllm=vllm-tp.json > summary.json

`--scaling`: a run with `--backend vllm --strategy elastic,cold_restart`: per transition, the
elastic scale's latency, downtime and peak memory beside cold-restarting vLLM on the same
machine (its latency ratio is the scaling benchmark's `latency_ratio_vs_cold_restart`).
`--throughput`: one `coordinator.bench.throughput` run per backend on the same arguments (model,
dtype, dps, concurrency, lengths, seed): output tokens/s, TTFT and TPOT per dp, and vLLM's
throughput over the native engine's. Standard library only.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any


def scaling_summary(doc: dict[str, Any]) -> list[dict[str, Any]]:
    """Per event: strategy, transition, latency (and over cold restart), downtime, memory, failures."""
    return [{
        "strategy": e["strategy"], "from_dp": e["from_dp"], "to_dp": e["to_dp"], "state": e["state"],
        "scale_latency_s": e["scale_latency_s"], "latency_ratio_vs_cold_restart": e["latency_ratio_vs_cold_restart"],
        "downtime_s": e["downtime_s"], "client_downtime_s": e["client_downtime_s"],
        "peak_hmm_bytes": e["peak_memory_bytes"], "peak_rank_private_bytes": e.get("peak_rank_private_bytes"),
        "rank_private_before_bytes": e.get("rank_private_before_bytes"),
        "failed_requests": e["failed_requests_total"], "requests_handed_over": e["requests_handed_over"],
    } for e in doc["events"]]


def throughput_summary(docs: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """backend -> per dp: output tokens/s, TTFT/TPOT medians, failures; and vLLM's over native's."""
    configs = {name: {k: v for k, v in doc["config"].items() if k != "backend"} for name, doc in docs.items()}
    if len({json.dumps(c, sort_keys=True) for c in configs.values()}) > 1:
        raise ValueError(f"--throughput: the runs differ in their workload: {configs}")
    out: dict[str, Any] = {"workload": next(iter(configs.values()), {})}
    for name, doc in docs.items():
        out[name] = {f"dp{r['dp']}": {k: r[k] for k in ("output_tok_s", "ttft_s_p50", "tpot_s_p50", "failed")}
                     for r in doc["results"]}
    if "native" in out and "vllm" in out:
        out["vllm_over_native_tok_s"] = {dp: out["vllm"][dp]["output_tok_s"] / out["native"][dp]["output_tok_s"]
                                         for dp in out["native"] if dp in out["vllm"]}
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m coordinator.bench.backend_compare", description=__doc__.splitlines()[0])
    p.add_argument("--scaling", default=None, metavar="FILE", help="scaling run with --backend vllm")
    p.add_argument("--throughput", nargs="*", default=[], metavar="BACKEND=FILE",
                   help="one coordinator.bench.throughput run per backend on the same workload")
    args = p.parse_args(argv)
    try:
        runs = dict(item.split("=", 1) for item in args.throughput)
        doc: dict[str, Any] = {"benchmark": "coordinator.bench.backend_compare"}
        if args.scaling:
            doc["scaling"] = scaling_summary(json.loads(Path(args.scaling).read_text()))
        if runs:
            doc["throughput"] = throughput_summary({k: json.loads(Path(v).read_text()) for k, v in runs.items()})
    except (OSError, ValueError, KeyError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(doc, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
