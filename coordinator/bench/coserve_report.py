"""Tables and the figure of the CoServe benchmark (`coordinator.bench.coserve`): paper Fig. 13
(throughput, latency, switches, hit rate per system) and Fig. 15 (where the policy time goes)."""

from __future__ import annotations

import statistics
from typing import Any


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{1000 * v:.0f}"


def _f(v: float | None, spec: str) -> str:
    return "-" if v is None else format(v, spec)


def _table(title: str, header: list[str], rows: list[list[str]]) -> str:
    lines = [title, "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


def _hot_p99(doc: dict[str, Any], dp: int, config: str, round_index: int = 0) -> float | None:
    """The hot requests' p99 TTFT in `config`'s run at `dp` in round `round_index`, if it ran."""
    run = next((r for r in doc["runs"] if r["dp"] == dp and r["config"] == config
                and r.get("round", 0) == round_index), None)
    return None if run is None else run["hot_ttft_s"]["p99"]


def _median(values: list[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


def _medians(doc: dict[str, Any]) -> str:
    """Per (dp, config), the medians over the rounds of what Fig. 13 compares, and throughput
    against CoServe's median at the same dp."""
    groups: dict[tuple[int, str], list[dict[str, Any]]] = {}
    for r in doc["runs"]:
        groups.setdefault((r["dp"], r["config"]), []).append(r)
    tok = {key: _median([r["throughput_tok_s"] for r in runs]) for key, runs in groups.items()}
    rows = []
    for (dp, config), runs in groups.items():
        rows.append([str(dp), config, str(len(runs)), _f(tok[(dp, config)], ".1f"),
                     _ratio(tok[(dp, config)], tok.get((dp, "coserve"))),
                     _ms(_median([r["ttft_s"]["p99"] for r in runs])), _ms(_median([r["hot_ttft_s"]["p99"] for r in runs])),
                     _f(_median([r.get("switches") for r in runs]), ".0f"), _f(_median([r.get("hit_rate") for r in runs]), ".3f"),
                     " / ".join(_f(r["throughput_tok_s"], ".0f") for r in runs)])
    return _table("Medians over the rounds (each round in another order of the configurations)",
                  ["dp", "config", "runs", "tok/s", "vs coserve", "TTFT p99 ms", "hot TTFT p99 ms", "switches",
                   "hit rate", "tok/s of each round"], rows)


def _ratio(value: float | None, base: float | None) -> str:
    return "-" if value is None or not base else f"{value / base:.2f}x"


def format_tables(doc: dict[str, Any]) -> str:
    cfg = doc["config"]
    rounds = cfg.get("rounds", 1) > 1
    fig13 = []
    for r in doc["runs"]:
        hot, k = r["hot_ttft_s"]["p99"], r.get("round", 0)
        fig13.append([
            str(r["dp"]), *([str(k)] if rounds else []), r["config"], _f(r["throughput_tok_s"], ".1f"),
            _ms(r["ttft_s"]["p50"]), _ms(r["ttft_s"]["p99"]),
            _ms(r["tpot_s"]["p50"]), _ms(r["tpot_s"]["p99"]), _f(r.get("switches"), ".0f"),
            _f((r.get("counters") or {}).get("lora_preloads"), ".0f"), _f(r.get("hit_rate"), ".3f"),
            _ms(hot), _ratio(hot, _hot_p99(doc, r["dp"], "resident", k)),
            _ratio(hot, _hot_p99(doc, r["dp"], "reference", k)),
            _ms(r["arrived_resident_ttft_s"]["p99"]), _ratio(r.get("arrived_resident_vs_resident"), 1.0),
            _ms(r["swapped_ttft_s"]["p99"]), str(r["failed"]), _f(r.get("register_s"), ".1f")])
    title = (f"CoServe Fig. 13 on the elastic server: {doc['num_adapters']['lora']} LoRA + {doc['num_adapters']['esft']} "
             f"ESFT adapters, {cfg['max_loras']} LoRA slots (of {cfg.get('lora_target_modules') or 'every module'}) / "
             f"{cfg['max_esft_adapters']} ESFT slots, power law alpha "
             f"{cfg['alpha']}, {cfg['rps']} req/s Poisson for {cfg['duration_s']:.0f} s ({doc['num_requests']} requests)")
    header = ["dp", *(["round"] if rounds else []), "config", "tok/s", "TTFT p50 ms", "TTFT p99 ms", "TPOT p50 ms", "TPOT p99 ms", "switches",
              "of them preloads", "hit rate", "hot TTFT p99 ms", "hot vs resident", "hot vs reference",
              "resident-on-arrival TTFT p99 ms", "same requests vs resident run", "swapped TTFT p99 ms", "failed",
              "register s"]
    fig15 = []
    for r in doc["runs"]:
        b = r.get("breakdown_s")
        if b is None:
            continue
        total = b["management"] + b["arranging"] + b["assigning"]
        fig15.append([str(r["dp"]), *([str(r.get("round", 0))] if rounds else []), r["config"],
                      f"{b['management_lora']:.3f}", f"{b['management_esft']:.2f}",
                      f"{1000 * b['arranging']:.1f}", f"{1000 * b['assigning']:.1f}",
                      "-" if not total else f"{100 * b['management'] / total:.1f} / {100 * b['arranging'] / total:.2f} / "
                      f"{100 * b['assigning'] / total:.2f}"])
    return "\n\n".join([
        _table(title, header, fig13),
        *([_medians(doc)] if rounds else []),
        _table("CoServe Fig. 15: time in adapter management (LoRA slot copies per rank, ESFT swaps start to resident), "
               "request arranging (ranks' schedulers) and assigning (ingress router), server-side",
               ["dp", *(["round"] if rounds else []), "config", "LoRA copies s", "ESFT swaps s", "arranging ms",
                "assigning ms", "% mgmt / arr / asg"],
               fig15)])


def plot(doc: dict[str, Any], path: str) -> None:
    """Bars per (dp, config): throughput, switches, hit rate, hot p99 TTFT; and the breakdown."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = doc["runs"]
    labels = [f"{r['config']}\ndp{r['dp']}" for r in runs]
    panels = [("output tok/s", [r["throughput_tok_s"] or 0 for r in runs]),
              ("switches", [r.get("switches") or 0 for r in runs]),
              ("hit rate", [r.get("hit_rate") or 0 for r in runs]),
              ("hot-adapter TTFT p99 (ms)", [1000 * (r["hot_ttft_s"]["p99"] or 0) for r in runs])]
    fig, axes = plt.subplots(1, 5, figsize=(22, 4))
    for ax, (title, values) in zip(axes[:4], panels, strict=True):
        ax.bar(range(len(runs)), values, color=[f"C{i % 10}" for i in range(len(runs))])
        ax.set_xticks(range(len(runs)), labels, fontsize=7)
        ax.set_title(title, fontsize=10)
    ax = axes[4]
    with_b = [r for r in runs if r.get("breakdown_s")]
    width = 0.27
    for j, (key, color) in enumerate((("management", "C3"), ("arranging", "C0"), ("assigning", "C2"))):
        ax.bar([i + (j - 1) * width for i in range(len(with_b))], [r["breakdown_s"][key] for r in with_b],
               width=width, color=color, label=key)
    ax.set_xticks(range(len(with_b)), [f"{r['config']}\ndp{r['dp']}" for r in with_b], fontsize=7)
    ax.set_yscale("log")
    ax.set_title("Fig. 15: policy time (s)", fontsize=10)
    ax.legend(fontsize=8)
    fig.suptitle(f"CoServe on the elastic server ({doc['num_adapters']['lora']} LoRA + {doc['num_adapters']['esft']} "
                 "ESFT adapters)", fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
