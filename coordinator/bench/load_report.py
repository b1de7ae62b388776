"""Pure figures of a load run (no I/O, no clocks): the JSON's per-request rows, summary and timeline.

Times are seconds on the records' axis (`loadgen.LoadResult`: since the load started).
An SLO bound of None means unbounded: with neither bound, attainment is the success rate.
A request attains the SLO when it succeeded within both bounds (`scale_metrics.attains_slo`).
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from coordinator.bench.loadgen import RequestRecord
from coordinator.bench.scale_metrics import SloBin, Window, attains_slo, slo_attainment_bins


def _bound(x: float | None) -> float:
    return math.inf if x is None else x


def is_attained(record: RequestRecord, slo_ttft_s: float | None, slo_tpot_s: float | None) -> bool:
    return attains_slo(record, _bound(slo_ttft_s), _bound(slo_tpot_s))


def slo_attainment_over_time(
    records: Sequence[RequestRecord],
    bin_s: float,
    slo_ttft_s: float | None,
    slo_tpot_s: float | None,
    end_s: float | None = None,
) -> list[SloBin]:
    """SLO attainment per `bin_s` bin of request arrival over `[0, end_s)` (default: past the last arrival)."""
    if end_s is None:
        end_s = max((r.arrival_s for r in records), default=0.0) + 1e-9
    return slo_attainment_bins(records, Window(0.0, max(end_s, bin_s)), _bound(slo_ttft_s), _bound(slo_tpot_s), bin_s)


def percentiles(values: Sequence[float]) -> dict[str, float | None]:
    """Mean, p50, p90 and p99 (inclusive interpolation); all None for no values."""
    if not values:
        return {"mean": None, "p50": None, "p90": None, "p99": None}
    if len(values) == 1:
        return {"mean": values[0], "p50": values[0], "p90": values[0], "p99": values[0]}
    q = statistics.quantiles(values, n=100, method="inclusive")
    return {"mean": statistics.fmean(values), "p50": q[49], "p90": q[89], "p99": q[98]}


def record_to_dict(r: RequestRecord) -> dict[str, Any]:
    """One request's row in the JSON (times in seconds since the load started)."""
    return {
        "request_id": r.request_id, "model": r.model, "arrival_s": r.arrival_s, "first_token_s": r.first_token_s,
        "finished_s": r.finished_s, "ttft_s": r.ttft_s, "tpot_s": r.tpot_s, "prompt_len": r.prompt_len,
        "max_tokens": r.max_tokens, "num_tokens": r.num_tokens, "status": r.status, "ok": r.is_ok,
        "error": r.error,
    }


def _latencies(records: Iterable[RequestRecord], f: Callable[[RequestRecord], float | None]) -> list[float]:
    return [x for r in records if r.is_ok and (x := f(r)) is not None]


def summarize(
    records: Sequence[RequestRecord], duration_s: float, slo_ttft_s: float | None, slo_tpot_s: float | None
) -> dict[str, Any]:
    """Counts, latency percentiles (successful requests), rates and SLO attainment of a run.

    `offered_rps` is over the arrival window `duration_s`; `completed_rps` and `output_tok_s` are
    over `[0, last finish]`, so requests draining after the window still count.
    """
    ok = [r for r in records if r.is_ok]
    end_s = max([duration_s, *(r.finished_s for r in ok if r.finished_s is not None)])
    attained = sum(is_attained(r, slo_ttft_s, slo_tpot_s) for r in records)
    errors = Counter(f"{r.status}: {r.error}" for r in records if not r.is_ok)
    by_model: dict[str, Any] = {}
    for name in dict.fromkeys(r.model or "" for r in records):
        mine = [r for r in records if (r.model or "") == name]
        by_model[name] = {
            "num_requests": len(mine),
            "num_failed": sum(not r.is_ok for r in mine),
            "ttft_s_p50": percentiles(_latencies(mine, lambda r: r.ttft_s))["p50"],
            "tpot_s_p50": percentiles(_latencies(mine, lambda r: r.tpot_s))["p50"],
        }
    return {
        "num_requests": len(records),
        "num_ok": len(ok),
        "num_failed": len(records) - len(ok),
        "errors": dict(errors.most_common(5)),  # the 5 most frequent "status: error", with counts
        "duration_s": duration_s,
        "wall_s": end_s,
        "offered_rps": len(records) / duration_s if duration_s > 0 else None,
        "completed_rps": len(ok) / end_s if end_s > 0 else None,
        "output_tok_s": sum(r.num_tokens for r in ok) / end_s if end_s > 0 else None,
        "ttft_s": percentiles(_latencies(records, lambda r: r.ttft_s)),
        "tpot_s": percentiles(_latencies(records, lambda r: r.tpot_s)),
        "e2e_s": percentiles(_latencies(records, lambda r: None if r.finished_s is None else r.finished_s - r.arrival_s)),
        "slo": {
            "ttft_s": slo_ttft_s,
            "tpot_s": slo_tpot_s,
            "num_attained": attained,
            "attainment": attained / len(records) if records else None,
        },
        "by_model": by_model,
    }


@dataclasses.dataclass(frozen=True, slots=True)
class TimeBin:
    start_s: float
    target_rps: float  # the schedule's rate at the bin's middle
    offered_rps: float  # arrivals in the bin / bin_s
    completed_rps: float  # successful finishes in the bin / bin_s
    num_requests: int  # arrivals in the bin
    attainment: float | None  # of the requests arriving in the bin (None: no arrivals)


def timeline(
    records: Sequence[RequestRecord],
    rps: Callable[[float], float],
    duration_s: float,
    bin_s: float,
    slo_ttft_s: float | None,
    slo_tpot_s: float | None,
) -> list[TimeBin]:
    """Per `bin_s` bin over `[0, duration_s)`: target, offered and completed rps and SLO attainment."""
    slo = slo_attainment_over_time(records, bin_s, slo_ttft_s, slo_tpot_s, end_s=duration_s)
    completed = [0] * len(slo)
    for r in records:
        if r.is_ok and r.finished_s is not None and 0 <= (i := int(r.finished_s // bin_s)) < len(slo):
            completed[i] += 1
    return [
        TimeBin(b.start_s, rps(b.start_s + bin_s / 2), b.num_requests / bin_s, completed[i] / bin_s,
                b.num_requests, b.attainment)
        for i, b in enumerate(slo)
    ]


def events_on_axis(events: Iterable[dict[str, Any]], t0_wall: float) -> list[dict[str, Any]]:
    """Server scale events (unix `started_at` / `finished_at`) with `start_s` / `end_s` on the records' axis
    (`end_s` None while running)."""
    out = []
    for e in events:
        if e.get("started_at") is None:
            continue
        finished = e.get("finished_at")
        out.append({**e, "start_s": e["started_at"] - t0_wall,
                    "end_s": None if finished is None else finished - t0_wall})
    return sorted(out, key=lambda e: e["start_s"])
