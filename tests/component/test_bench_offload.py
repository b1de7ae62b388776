"""`python -m elasticmoe.bench.offload` end to end on the tiny model: every run's row, the
resident reference, the sweeps, the transfer timings and the plot."""

from __future__ import annotations

import argparse
import json

import pytest

from elasticmoe.bench import offload as offload_bench
from elasticmoe.bench.offload import main


def test_offload_bench_reports_every_policy_budget_and_sweep(tiny_model_dir, tmp_path, capsys):
    plot = tmp_path / "offload.png"
    assert main(["--model", tiny_model_dir, "--policies", "finemoe,on_demand", "--budgets", "0.25,1.0",
                 "--distances", "1,2", "--capacities", "8", "--warmup", "2", "--requests", "2", "--max-tokens", "4",
                 "--json", "--plot", str(plot)]) == 0
    report = json.loads(capsys.readouterr().out)
    runs = report["runs"]
    assert [(r["policy"], r["budget"], r["prefetch_distance"], r["store_capacity"]) for r in runs] == [
        ("resident", 1.0, 1, 1000), ("finemoe", 0.25, 1, 1000), ("finemoe", 1.0, 1, 1000),
        ("on_demand", 0.25, 1, 1000), ("on_demand", 1.0, 1, 1000), ("finemoe", 0.25, 2, 1000),
        ("finemoe", 0.25, 1, 8)]
    for run in runs:
        assert run["output_tokens"] == 2 * 4 and run["ttft_p50_ms"] > 0 and run["tpot_p50_ms"] > 0
        assert 0.0 <= run["hit_rate"] <= 1.0
    quarter = runs[3]["cache"]  # on_demand at 25%: misses load on demand, nothing is prefetched
    assert quarter["on_demand_loads"] > 0 and quarter["prefetches"] == 0 and runs[3]["hit_rate"] < 1.0
    # the measured part's hit rate, and the cache's size as it is (not a difference of two snapshots)
    assert quarter["hit_rate"] == runs[3]["hit_rate"] and quarter["capacity_experts"] > 0
    assert quarter["cache_bytes"] == quarter["capacity_experts"] * quarter["expert_bytes"]
    transfers = report["transfers"]
    assert transfers["expert_bytes"] > 0 and min(transfers["host_copy_s"], transfers["disk_warm_s"]) > 0
    # the probe copies rows as the caches hold them (a bf16 checkpoint computed in fp32 keeps bf16 rows)
    assert transfers["expert_bytes"] == quarter["expert_bytes"] and runs[3]["expert_dtype"] in ("float32", "bfloat16")
    assert plot.stat().st_size > 0


def test_offload_bench_refuses_an_unknown_policy(tiny_model_dir):
    with pytest.raises(SystemExit):
        main(["--model", tiny_model_dir, "--policies", "belady"])


@pytest.mark.parametrize("flag, value", [("--capacities", "x"), ("--capacities", "0"), ("--distances", "-1"),
                                         ("--budgets", ""), ("--budgets", "1.5"), ("--rounds", "0")])
def test_offload_bench_refuses_bad_sweeps_naming_the_flag(tiny_model_dir, capsys, flag, value):
    with pytest.raises(SystemExit) as exit_:
        main(["--model", tiny_model_dir, flag, value])
    assert exit_.value.code == 2 and flag in capsys.readouterr().err


def test_offload_bench_with_empty_sweeps_runs_the_budgets_only(tiny_model_dir, capsys):
    assert main(["--model", tiny_model_dir, "--policies", "finemoe", "--budgets", "1.0", "--distances", "",
                 "--capacities", "", "--warmup", "1", "--requests", "1", "--max-tokens", "2", "--json",
                 "--expert-page-cache", "drop"]) == 0
    report = json.loads(capsys.readouterr().out)
    runs = report["runs"]
    assert report["expert_page_cache"] == "drop"
    assert [(r["policy"], r["prefetch_distance"], r["store_capacity"]) for r in runs] == [
        ("resident", 1, 1000), ("finemoe", 1, 1000)]


def test_offload_bench_rounds_report_medians_and_ratios_to_their_paired_resident_runs(tiny_model_dir, capsys):
    assert main(["--model", tiny_model_dir, "--policies", "on_demand", "--budgets", "0.25", "--distances", "",
                 "--capacities", "", "--warmup", "1", "--requests", "1", "--max-tokens", "3", "--rounds", "3",
                 "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    resident, quarter = report["runs"]
    assert report["rounds"] == 3 and len(resident["rounds_tpot_p50_ms"]) == len(quarter["rounds_tpot_p50_ms"]) == 3
    assert resident["rounds_tpot_vs_resident"] == [1.0, 1.0, 1.0] and resident["tpot_vs_resident"] == 1.0
    paired = quarter["rounds_paired_resident_tpot_p50_ms"]
    assert len(paired) == 3 and min(paired) > 0
    want = sorted(round(q / r, 3) for q, r in zip(quarter["rounds_tpot_p50_ms"], paired, strict=True))
    assert sorted(quarter["rounds_tpot_vs_resident"]) == want and quarter["tpot_vs_resident"] == want[1]
    assert quarter["tpot_p50_ms"] == sorted(quarter["rounds_tpot_p50_ms"])[1]
    assert report["resident_tpot_p50_ms"] == sorted(resident["rounds_tpot_p50_ms"])[1]


def test_a_configurations_measured_requests_alternate_with_the_resident_reference(tiny_model_dir, monkeypatch):
    calls: list[tuple[str, list[str]]] = []
    drive = offload_bench._drive

    def recorded(engine, prompts, params, batch):
        calls.append(("reference" if engine is reference else "config", list(prompts)))
        return drive(engine, prompts, params, batch)

    args = argparse.Namespace(model=tiny_model_dir, dtype="float32", threads=1, warmup=1, batch=1, max_tokens=3,
                              semantic="iteration", policy_thread=False, expert_page_cache="drop")
    reference = offload_bench.build_engine(args)
    monkeypatch.setattr(offload_bench, "_drive", recorded)
    try:
        result = offload_bench.run_once(args, ["w", "a", "b", "c"], "on_demand", 0.25, 1, 1000, reference)
    finally:
        reference.close()
    assert calls == [("config", ["w"]),  # the warm-up, then chunks of --batch, the order swapped each time
                     ("reference", ["a"]), ("config", ["a"]), ("config", ["b"]), ("reference", ["b"]),
                     ("reference", ["c"]), ("config", ["c"])]
    assert result.output_tokens == 3 * 3 and result.paired_resident_tpot_p50_ms > 0 and result.cache["lookups"] > 0
