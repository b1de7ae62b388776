"""PNG plots of a load report (the JSON document of `coordinator.bench.load`), matplotlib Agg.

`plot_timeline`: SLO attainment and target / offered / completed rps per time bin, with the
server's scale events as shaded spans. `plot_cdfs`: TTFT and TPOT CDFs of the successful
requests (overall, and per model when a few models are mixed), with the SLO bounds.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

MAX_MODEL_CURVES = 6


def cdf_path(path: str) -> str:
    """Where the CDF plot goes next to the timeline plot: `out.png` -> `out-cdf.png`."""
    p = Path(path)
    return str(p.with_name(f"{p.stem}-cdf{p.suffix or '.png'}"))


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _slo_text(slo: dict[str, Any]) -> str:
    bounds = [f"{name} <= {slo[key]:g}s" for name, key in (("TTFT", "ttft_s"), ("TPOT", "tpot_s"))
              if slo[key] is not None]
    return "SLO " + ", ".join(bounds) if bounds else "no SLO bounds: success rate"


def _mark_events(ax: Any, events: list[dict[str, Any]], end_s: float, label: bool) -> None:
    for i, e in enumerate(events):
        start, end = e["start_s"], e["end_s"] if e["end_s"] is not None else end_s
        text = f"dp {e.get('from_dp')}->{e.get('to_dp')} {e.get('strategy', '')} ({e.get('state', '?')})"
        ax.axvspan(start, max(end, start + 1e-3), color=f"C{3 + i % 6}", alpha=0.2, label=text if label else None)
        ax.axvline(start, color=f"C{3 + i % 6}", linewidth=1)


def plot_timeline(doc: dict[str, Any], path: str) -> None:
    """Two stacked panels over the run: SLO attainment %, and target / offered / completed rps."""
    plt = _pyplot()
    bins, cfg, summary = doc["timeline"], doc["config"], doc["summary"]
    bin_s = doc["timeline_bin_s"]
    events = doc.get("scale_events") or []
    end_s = max(summary["wall_s"], cfg["duration_s"])
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(9, 5.5), sharex=True)
    mids = [b["start_s"] + bin_s / 2 for b in bins]
    slo = [(m, 100 * b["attainment"]) for m, b in zip(mids, bins, strict=True) if b["attainment"] is not None]
    top.plot([m for m, _ in slo], [a for _, a in slo], marker=".", color="C0")
    top.set_ylim(-5, 105)
    top.set_ylabel("SLO attained %")
    top.set_title(f"{_slo_text(summary['slo'])}; {bin_s:g} s bins by arrival", fontsize=9)
    bottom.plot(mids, [b["target_rps"] for b in bins], color="black", linestyle="--", linewidth=1, label="target")
    bottom.stairs([b["offered_rps"] for b in bins], [*(b["start_s"] for b in bins), bins[-1]["start_s"] + bin_s],
                  color="C1", label="offered (arrivals)")
    bottom.plot(mids, [b["completed_rps"] for b in bins], color="C2", marker=".", label="completed")
    bottom.set_ylabel("requests/s")
    bottom.set_xlabel("seconds since the load started")
    for ax in (top, bottom):
        _mark_events(ax, events, end_s, label=ax is bottom)
        ax.grid(alpha=0.3)
    bottom.legend(fontsize=8, loc="upper left")
    fig.suptitle(f"{cfg['pattern']} load on {cfg['url']}: {summary['num_requests']} requests, "
                 f"{summary['num_failed']} failed", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _cdf(ax: Any, values: list[float], **kwargs: Any) -> None:
    xs = sorted(values)
    if xs:
        ax.step(xs, [(i + 1) / len(xs) for i in range(len(xs))], where="post", **kwargs)


def plot_cdfs(doc: dict[str, Any], path: str) -> None:
    """TTFT and TPOT CDFs side by side; the SLO bounds as vertical lines."""
    plt = _pyplot()
    rows = [r for r in doc["requests"] if r["ok"]]
    slo = doc["summary"]["slo"]
    models = list(dict.fromkeys(r["model"] for r in rows))
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.8))
    for ax, key, name in ((axes[0], "ttft_s", "TTFT"), (axes[1], "tpot_s", "TPOT")):
        _cdf(ax, [r[key] for r in rows if r[key] is not None], color="black", label="all")
        if 1 < len(models) <= MAX_MODEL_CURVES:
            for i, m in enumerate(models):
                _cdf(ax, [r[key] for r in rows if r["model"] == m and r[key] is not None], color=f"C{i}",
                     linewidth=1, alpha=0.8, label=m)
        if slo[key] is not None:
            ax.axvline(slo[key], color="red", linestyle=":", label=f"SLO {slo[key]:g}s")
        ax.set_xlabel(f"{name} (s)")
        ax.set_ylim(0, 1.02)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8, loc="lower right")
    axes[0].set_ylabel("fraction of successful requests")
    fig.suptitle(f"{len(rows)} successful of {doc['summary']['num_requests']} requests", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
