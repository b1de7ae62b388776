"""The CoServe benchmark's pure helpers: popularity, the seeded workload, summary statistics and
the server's counters turned into switches, hit rate and the Fig. 15 breakdown."""

from __future__ import annotations

import pytest

from coordinator.bench.coserve import parse_args
from coordinator.bench.coserve_report import format_tables
from coordinator.bench.coserve_workload import (
    CONFIGS,
    Adapter,
    Arrival,
    counter_delta,
    hit_rate,
    latency_summary,
    make_arrivals,
    parse_metrics,
    percentile,
    popularity,
    server_counters,
    used_adapters,
)


def test_popularity_is_a_seeded_power_law_over_a_permutation():
    names = [f"a{i}" for i in range(100)]
    shares = popularity(names, 0.3, seed=1)
    assert set(shares) == set(names) and sum(shares.values()) == pytest.approx(1.0)
    ranked = sorted(shares.values(), reverse=True)
    assert ranked[0] == pytest.approx(0.01 ** 0.3) and ranked[0] > 10 * ranked[-1]  # skewed
    assert shares == popularity(names, 0.3, seed=1) and shares != popularity(names, 0.3, seed=2)


def test_arrivals_are_poisson_seeded_and_follow_the_shares():
    shares = {"hot": 0.9, "cold": 0.1}
    arrivals = make_arrivals(shares, 0.2, rps=50.0, duration_s=20.0, prompt_len=4, max_tokens=3, vocab_size=64, seed=0)
    assert 800 < len(arrivals) < 1200  # ~ rps * duration
    assert all(0 <= a.arrival_s < 20 for a in arrivals) and arrivals == sorted(arrivals, key=lambda a: a.arrival_s)
    models = [a.model for a in arrivals]
    assert 0.15 < models.count(None) / len(models) < 0.25
    assert models.count("hot") > 5 * models.count("cold") > 0
    assert all(len(a.prompt) == 4 and all(5 <= t < 64 for t in a.prompt) and a.max_tokens == 3 for a in arrivals)
    again = make_arrivals(shares, 0.2, 50.0, 20.0, 4, 3, 64, seed=0)
    assert again == arrivals
    with pytest.raises(ValueError, match="rps"):
        make_arrivals(shares, 0.2, 0.0, 20.0, 4, 3, 64, seed=0)


def test_the_resident_run_registers_only_the_adapters_the_arrivals_use():
    adapters = [Adapter(n, kind, f"/a/{n}", 0.25) for n, kind in (("l0", "lora"), ("e0", "esft"), ("l1", "lora"),
                                                                  ("e1", "esft"))]
    arrivals = [Arrival(0.1 * i, model, [5], 2) for i, model in enumerate(("l1", None, "e0", "l1"))]
    assert [a.name for a in used_adapters(adapters, arrivals)] == ["e0", "l1"]  # registration order
    assert used_adapters(adapters, [Arrival(0.0, None, [5], 2)]) == []


def test_percentiles_and_summary():
    assert percentile([], 50) is None
    assert percentile([3.0], 99) == 3.0
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5
    assert percentile(list(range(101)), 99) == pytest.approx(99.0)
    s = latency_summary([0.1, None, 0.3])
    assert s["p50"] == pytest.approx(0.2) and s["mean"] == pytest.approx(0.2)
    assert latency_summary([None]) == {"p50": None, "p99": None, "mean": None}


def test_server_counters_switches_and_hit_rate():
    metrics = parse_metrics("# HELP x\nelasticmoe_lora_swaps_in_total 10.0\nelasticmoe_lora_hits_total 30.0\n"
                            "elasticmoe_lora_preloads_total 4.0\n"
                            "elasticmoe_lora_misses_total 10.0\nelasticmoe_lora_swap_seconds_total 0.5\n"
                            'elasticmoe_kv_cache_usage_ratio{rank="0"} 0.1\n'
                            "elasticmoe_request_arranging_seconds_total 0.002\n")
    assert "elasticmoe_kv_cache_usage_ratio" not in metrics
    status = {"adapter_swaps": {"esft_swaps_in": 3, "esft_swap_s": 1.5, "lora_swaps": "lockstep"},
              "requests": {"swap_waits": 4, "assigning_s": 0.01}, "active_config": {"dp": 2}}
    after = server_counters(metrics, status)
    assert after["lora_swaps_in"] == 5 and after["lora_swap_s"] == 0.25  # lockstep: each switch on both ranks
    per_rank = {**status, "adapter_swaps": {**status["adapter_swaps"], "lora_swaps": "per rank"}}
    alone = server_counters(metrics, per_rank)  # ranks swapping their own slots
    assert alone["lora_swaps_in"] == 10 and alone["lora_swap_s"] == 0.5 and alone["lora_preloads"] == 4
    assert after["lora_preloads"] == 2
    assert after["esft_swaps_in"] == 3 and after["assigning_s"] == 0.01 and after["arranging_s"] == 0.002
    delta = counter_delta(after, {**after, "lora_hits": 10.0})
    assert delta["lora_hits"] == 20 and delta["lora_swaps_in"] == 0
    rate, hits, misses = hit_rate(after, num_esft_requests=10)  # 30 + (10 - 4) hits, 10 + 4 misses
    assert (hits, misses) == (36, 14) and rate == pytest.approx(36 / 50)
    zero = dict.fromkeys(after, 0.0)
    assert hit_rate(zero, 0) == (None, 0, 0)


def test_args_and_tables():
    args = parse_args(["--preset", "tiny", "--dps", "1", "--configs", "coserve,reference"])
    assert args.dps == [1] and args.configs == ["coserve", "reference"] and args.model.endswith("tiny-qwen3-moe")
    assert args.max_num_batched_tokens is None  # the engine's budget unless given
    assert parse_args(["--max-num-batched-tokens", "96"]).max_num_batched_tokens == 96
    with pytest.raises(SystemExit):
        parse_args(["--max-num-batched-tokens", "0"])
    with pytest.raises(SystemExit):
        parse_args(["--configs", "nope"])
    assert parse_args(["--lora-target-modules", "q_proj,v_proj"]).lora_target_modules == "q_proj,v_proj"
    with pytest.raises(SystemExit):
        parse_args(["--lora-target-modules", "q_proj,qv"])
    assert set(CONFIGS) == {"coserve", "lru_fcfs", "fifo", "parallel"}
    lat = {"p50": 0.01, "p99": 0.02, "mean": 0.01}
    run = {"dp": 1, "config": "coserve", "throughput_tok_s": 10.0, "ttft_s": lat, "tpot_s": lat, "hot_ttft_s": lat,
           "switches": 3.0, "counters": {"lora_preloads": 1.0}, "hit_rate": 0.5, "failed": 0, "register_s": 1.0,
           "breakdown_s": {"management": 1.0, "management_lora": 0.1, "management_esft": 0.9, "arranging": 0.001,
                           "assigning": 0.002},
           "arrived_resident_ttft_s": {**lat, "p99": 0.018}, "arrived_resident_vs_resident": 1.125,
           "swapped_ttft_s": {**lat, "p99": 0.5}}
    none = {"p50": None, "p99": None, "mean": None}
    ref = {**run, "config": "reference", "hot_ttft_s": {**lat, "p99": 0.01}, "breakdown_s": None,
           "arrived_resident_ttft_s": none, "arrived_resident_vs_resident": None, "swapped_ttft_s": none}
    resident = {**run, "config": "resident", "hot_ttft_s": {**lat, "p99": 0.016}, "switches": 0.0, "counters": None,
                "arrived_resident_ttft_s": {**lat, "p99": 0.016}, "arrived_resident_vs_resident": None,
                "swapped_ttft_s": none}
    doc = {"config": {"max_loras": 2, "max_esft_adapters": 1, "alpha": 0.3, "rps": 2.0, "duration_s": 5.0},
           "num_adapters": {"lora": 6, "esft": 3}, "num_requests": 10, "runs": [run, resident, ref]}
    text = format_tables(doc)
    assert "| 1 | coserve | 10.0 | 10 | 20 | 10 | 20 | 3 | 1 | 0.500 | 20 | 1.25x | 2.00x | 18 | 1.12x | 500 | 0 | 1.0 |" in text
    assert "| 1 | resident | 10.0 | 10 | 20 | 10 | 20 | 0 | - | 0.500 | 16 | 1.00x | 1.60x | 16 | - | - | 0 | 1.0 |" in text
    doc["runs"] = [run]  # neither baseline ran
    assert "| 1 | coserve | 10.0 | 10 | 20 | 10 | 20 | 3 | 1 | 0.500 | 20 | - | - | 18 | 1.12x | 500 | 0 | 1.0 |" in (
        format_tables(doc))
    assert "Fig. 15" in text and "| 1 | coserve | 0.100 | 0.90 | 1.0 | 2.0 |" in text


def test_requests_resident_on_arrival_are_paired_with_the_same_requests_of_the_resident_run():
    from coordinator.bench.coserve import pair_arrived_resident

    # Request 2 was resident on arrival in the CoServe run; 3 waited for a swap; 1 is the base model.
    coserve = {"dp": 1, "config": "coserve", "_ttft_by_id": {1: 0.1, 2: 0.3, 3: 2.0}, "_arrived_resident_ids": [2]}
    resident = {"dp": 1, "config": "resident", "_ttft_by_id": {1: 0.1, 2: 0.2, 3: 0.2},
                "_arrived_resident_ids": [2, 3]}
    other_dp = {"dp": 2, "config": "coserve", "_ttft_by_id": {2: 0.3}, "_arrived_resident_ids": [2]}
    rows = [coserve, resident, other_dp]
    pair_arrived_resident(rows)
    assert coserve["arrived_resident_vs_resident"] == pytest.approx(1.5)  # 0.3 against the same request's 0.2
    assert resident["arrived_resident_vs_resident"] is None and other_dp["arrived_resident_vs_resident"] is None
    assert all(not k.startswith("_") for row in rows for k in row)  # nothing per-request left in the JSON


def test_rounds_rotate_the_order_and_the_tables_add_medians():
    from coordinator.bench.coserve import pair_arrived_resident, rotated

    configs = ["coserve", "parallel", "fifo"]
    assert [rotated(configs, k) for k in range(4)] == [configs, ["parallel", "fifo", "coserve"],
                                                        ["fifo", "coserve", "parallel"], configs]
    assert parse_args(["--rounds", "3"]).rounds == 3
    with pytest.raises(SystemExit):
        parse_args(["--rounds", "0"])
    lat = {"p50": 0.01, "p99": 0.02, "mean": 0.01}

    def run(config: str, k: int, tok: float, switches: float, hot_p99: float) -> dict:
        return {"dp": 2, "round": k, "config": config, "throughput_tok_s": tok, "ttft_s": lat, "tpot_s": lat,
                "hot_ttft_s": {**lat, "p99": hot_p99}, "switches": switches, "counters": None, "hit_rate": 0.5,
                "failed": 0, "register_s": 1.0, "breakdown_s": None, "arrived_resident_ttft_s": lat,
                "arrived_resident_vs_resident": None, "swapped_ttft_s": lat}

    runs = [run("coserve", 0, 100.0, 10, 0.02), run("resident", 0, 90.0, 0, 0.01),
            run("resident", 1, 95.0, 0, 0.04), run("coserve", 1, 120.0, 12, 0.02),
            run("coserve", 2, 110.0, 11, 0.02), run("resident", 2, 99.0, 0, 0.01)]
    doc = {"config": {"max_loras": 2, "max_esft_adapters": 1, "alpha": 0.3, "rps": 2.0, "duration_s": 5.0,
                      "rounds": 3}, "num_adapters": {"lora": 6, "esft": 3}, "num_requests": 10, "runs": runs}
    text = format_tables(doc)
    # each run's hot requests against the resident run of its own round (round 1's was slower)
    assert "| 2 | 0 | coserve | 100.0 | 10 | 20 | 10 | 20 | 10 | - | 0.500 | 20 | 2.00x |" in text
    assert "| 2 | 1 | coserve | 120.0 | 10 | 20 | 10 | 20 | 12 | - | 0.500 | 20 | 0.50x |" in text
    assert "| 2 | coserve | 3 | 110.0 | 1.00x | 20 | 20 | 11 | 0.500 | 100 / 120 / 110 |" in text
    assert "| 2 | resident | 3 | 95.0 | 0.86x | 20 | 10 | 0 | 0.500 | 90 / 95 / 99 |" in text
    rows = [{"dp": 1, "config": "coserve", "round": 1, "_ttft_by_id": {2: 0.3}, "_arrived_resident_ids": [2]},
            {"dp": 1, "config": "resident", "round": 0, "_ttft_by_id": {2: 0.1}, "_arrived_resident_ids": [2]},
            {"dp": 1, "config": "resident", "round": 1, "_ttft_by_id": {2: 0.2}, "_arrived_resident_ids": [2]}]
    pair_arrived_resident(rows)
    assert rows[0]["arrived_resident_vs_resident"] == pytest.approx(1.5)  # against its own round's 0.2
