"""The scaling benchmark's tables (stderr) and its SLO-attainment plot (paper Fig. 9), from the
JSON document `coordinator.bench.scaling` builds."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


def fmt(x: Any, spec: str = ".2f") -> str:
    return "-" if x is None else format(x, spec)


def _mib(x: int | None) -> str:
    return "-" if x is None else f"{x / (1 << 20):.1f}"


def _moved(e: dict[str, Any], *sources: str) -> str:
    moved = e.get("bytes_moved")
    return "-" if not moved else _mib(sum(moved.get(f"bytes_{s}", 0) for s in sources))


def format_tables(doc: dict[str, Any]) -> str:
    head = ("strategy", "dp", "state", "latency_s", "x_cold", "downtime_s", "client_down_s", "baseline_s",
            "peak_MiB", "rank_MiB", "gloo_MiB", "veth_MiB", "disk_MiB", "nodes", "failed", "tok/s before", "during", "after")
    rows: list[tuple[str, ...]] = [head]
    for e in doc["events"]:
        tp = e["throughput_tok_s"]
        state = f"{e['state']} (ran {e['strategy_applied']})" if e["strategy_ignored"] else e["state"]
        rows.append((e["strategy"], f"{e['from_dp']}->{e['to_dp']}", state, fmt(e["scale_latency_s"]),
                     fmt(e["latency_ratio_vs_cold_restart"]), fmt(e["downtime_s"], ".3f"),
                     fmt(e["client_downtime_s"]), fmt(e["baseline_client_downtime_s"]),
                     _mib(e["peak_memory_bytes"]), _mib(e.get("peak_rank_private_bytes")),
                     _moved(e, "p2p_gloo"), _mib(e.get("veth_bytes")), _moved(e, "disk"),
                     str(e.get("num_rank_nodes", "-")), f"{e['failed_requests_total']}/{e['num_requests']}",
                     fmt(tp["before"], ".1f"), fmt(tp["during"], ".1f"), fmt(tp["after"], ".1f")))
    lines = [_table(rows)]
    if doc["ablation"]:
        a, b = doc["config"]["ablation_transition"]
        lines.append(f"\nablation (cumulative), DP{a} -> DP{b}")
        rows = [("configuration", "state", "scale_s", "downtime_s", "client_down_s", "peak_MiB")]
        rows += [(r["configuration"], r["state"], fmt(r["scale_latency_s"]), fmt(r["downtime_s"], ".3f"),
                  fmt(r["client_downtime_s"]), _mib(r["peak_memory_bytes"])) for r in doc["ablation"]]
        lines.append(_table(rows))
    return "\n".join(lines)


def _table(rows: Sequence[tuple[str, ...]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows)


def plot_slo(doc: dict[str, Any], path: str) -> None:
    """Paper Fig. 9: SLO attainment per 1 s arrival bin, one subplot per strategy, t=0 at the POST."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    strategies = list(dict.fromkeys(e["strategy"] for e in doc["events"]))
    fig, axes = plt.subplots(len(strategies), 1, figsize=(8, 2.4 * len(strategies)), sharex=True, squeeze=False)
    cfg = doc["config"]
    for ax, strategy in zip(axes[:, 0], strategies, strict=True):
        for i, e in enumerate(x for x in doc["events"] if x["strategy"] == strategy):
            color = f"C{i}"
            bins = [b for b in e["slo_bins"] if b["attainment"] is not None]
            ax.plot([b["t_s"] + 0.5 for b in bins], [100 * b["attainment"] for b in bins], color=color,
                    marker=".", label=f"DP{e['from_dp']}->DP{e['to_dp']} ({e['state']})")
            ax.axvline(e["finished_s"] - e["post_s"], color=color, linestyle="--", linewidth=1)
        ax.axvline(0.0, color="black", linestyle=":", linewidth=1)
        ax.set_ylim(-5, 105)
        ax.set_ylabel("SLO %")
        ax.set_title(strategy, fontsize=10)
        ax.legend(fontsize=8, loc="lower left")
    axes[-1, 0].set_xlabel("seconds since the scale POST (dotted: POST; dashed: event finished)")
    fig.suptitle(f"SLO attainment (TTFT <= {cfg['slo_ttft_s']}s, TPOT <= {cfg['slo_tpot_s']}s), "
                 f"{cfg['rps']} req/s, 1 s bins by arrival", fontsize=10)
    fig.tight_layout(rect=(0, 0, 1, 0.97))  # leave room for the suptitle
    fig.savefig(path, dpi=100)
    plt.close(fig)
