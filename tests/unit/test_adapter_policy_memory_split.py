"""The decay-window search and the memory split (CoServe §4.4) over hand-made profiles."""

from __future__ import annotations

import random

import pytest

from elasticmoe.adapter_policy.memory_split import (
    CacheItem,
    decay_window_search,
    estimate_throughput,
    plan_memory_split,
    profile_items,
    sorted_items,
)
from elasticmoe.adapter_policy.profile import KindProfile, Profile


def make_profile(max_batch: int = 4, lora_bytes: int = 1000, probabilities=None, kinds=None, **kw) -> Profile:
    probabilities = {"a": 0.5, "b": 0.3} if probabilities is None else probabilities
    return Profile(
        model="m", device="cpu",
        kinds=kinds or {"base": KindProfile(8, 0.01, 0.05),
                        "lora": KindProfile(max_batch, 0.02, 0.1, load_s=0.5, footprint_bytes=lora_bytes)},
        kv_bytes_per_token=10, tokens_per_request=10,
        usage_probability=probabilities, adapter_kind=dict.fromkeys(probabilities, "lora"), **kw)


def test_the_paper_window_rises_then_stops_where_throughput_falls():
    # Initial window 15 % (decay 0.85): windows [0, 15], [15, 27.75], [27.75, 38.59] (§5.3: "28 to
    # 39 experts"); the throughput peaks at 30 items, so the third window's probe falls short.
    found = decay_window_search(lambda n: float(n if n <= 30 else 60 - n), 100)
    assert [n for n, _ in found.probes] == [15, 28, 39]
    assert (found.lower_pct, found.upper_pct) == (pytest.approx(27.75), pytest.approx(38.5875))
    assert (found.lower, found.upper, found.choice) == (28, 39, 33)
    assert 28 <= decay_window_search(lambda n: float(n if n <= 30 else 60 - n), 100,
                                     rng=random.Random(1)).choice <= 39


def test_one_value_predicts_a_flat_line_and_the_error_margin_decides():
    # Second probe 4 % below the first: inside a 5 % margin, so the search goes on; 6 %: it stops.
    assert len(decay_window_search(lambda n: 100.0 if n == 15 else 96.0 - n / 100, 100).probes) > 2
    found = decay_window_search(lambda n: 100.0 if n == 15 else 94.0, 100)
    assert (found.lower, found.upper) == (15, 28)


def test_narrow_windows_slide_on_to_the_next_item_and_the_search_ends_at_every_item():
    found = decay_window_search(lambda n: 2.0**n, 4)  # rising faster than any line: to the end
    assert [n for n, _ in found.probes] == [1, 2, 3, 4]  # every item count once, none twice
    assert (found.lower, found.upper) == (3, 4) and found.choice == 3
    assert decay_window_search(lambda n: 1.0, 0).probes == ()
    with pytest.raises(ValueError, match="initial_window"):
        decay_window_search(lambda n: 1.0, 10, initial_window=100)


def test_estimate_throughput_by_hand():
    profile = make_profile()
    items = sorted_items(profile_items(profile))
    assert [i.name for i in items] == ["a", "b"]
    # n = 2: KV 400 bytes = 4 requests = max batch; K = .2*.01 + .8*.02, B = .2*.05 + .8*.1; no switch.
    assert estimate_throughput(profile, items, 2, 2400) == pytest.approx(4 / (0.018 * 4 + 0.09))
    # n = 1: b is not resident: every request pays 0.3 * 0.5 s of expected switch.
    assert estimate_throughput(profile, items, 1, 2400) == pytest.approx(4 / (0.018 * 4 + 0.09 + 4 * 0.15))
    assert estimate_throughput(profile, items, 2, 2050) == 0.0  # not one request's KV left


def test_limited_computation_reserves_the_max_batch_and_loads_what_fits():
    profile = make_profile(probabilities={f"a{i}": 0.1 for i in range(8)})
    # max batch 4 * 100 bytes <= 25 % of 10_000: keep 400 bytes of KV, load 9 of 1000 bytes... 8 exist.
    split = plan_memory_split(profile, 10_000)
    assert (split.strategy, split.num_lora_slots, split.kv_cache_bytes, split.max_num_seqs) == (
        "limited", 8, 2000, 4)
    split = plan_memory_split(profile, 5_000)
    assert (split.num_lora_slots, split.kv_cache_bytes) == (4, 1000)  # 4 slots + >= 400 bytes of KV


def test_sufficient_computation_searches_the_window_with_the_profile_model():
    probabilities = {f"a{i}": p for i, p in enumerate([0.4, 0.2, 0.1, 0.1, 0.05, 0.05, 0.04, 0.03, 0.02, 0.01])}
    kinds = {"base": KindProfile(64, 0.01, 0.05), "lora": KindProfile(64, 0.02, 0.1, 0.5, 100)}
    profile = make_profile(probabilities=probabilities, kinds=kinds)
    split = plan_memory_split(profile, 4_000)  # a full batch's KV (6400 bytes) would not even fit
    items = sorted_items(profile_items(profile))
    limit = 10  # every item fits beside one request's KV
    found = decay_window_search(lambda n: estimate_throughput(profile, items, n, 4_000), limit)
    assert split.strategy == "decay_window" and split.window == (found.lower, found.upper)
    assert split.num_lora_slots == found.choice
    assert split.kv_cache_bytes == 4_000 - 100 * found.choice and split.used_bytes == 4_000
    assert split.max_num_seqs == min(64, split.kv_cache_bytes // 100)
    assert [n for n, _ in found.probes][:2] == [2, 3] and 0 < found.choice <= limit
    # A sample run may replace the model: the window follows what it measures.
    split = plan_memory_split(profile, 4_000, measure=lambda n: float(n if n <= 2 else 0))
    assert split.window == (2, 3) and split.num_lora_slots == 2


def test_esft_adapters_and_experts_share_the_search_as_slots_and_rows():
    kinds = {"base": KindProfile(8, 0.01, 0.05), "lora": KindProfile(4, 0.02, 0.1, 0.5, 1000),
             "esft": KindProfile(4, 0.02, 0.1, 0.5, 3000), "expert": KindProfile(8, 0.0, 0.0, 0.1, 500)}
    profile = Profile("m", "cpu", kinds, 10, 10, usage_probability={"a": 0.5, "e": 0.2, "e2": 0.01},
                      adapter_kind={"a": "lora", "e": "esft", "e2": "esft"})
    items = [CacheItem("a", "lora", 0.5), CacheItem("e", "esft", 0.2), CacheItem("e2", "esft", 0.01),
             CacheItem("x0", "expert", 1.0), CacheItem("x1", "expert", 0.9)]
    # Max batch 4 x 100 bytes of KV is small: limited. By probability x0, x1, a, e, e2: 8000 bytes fit.
    split = plan_memory_split(profile, 10_000, items)
    assert split.strategy == "limited"
    assert (split.num_expert_rows, split.num_lora_slots, split.num_esft_slots, split.esft_bytes) == (2, 1, 2, 6000)
    assert split.kv_cache_bytes == 2000 and split.used_bytes == 10_000 and split.max_num_seqs == 4
    assert split.engine_fields() == {"kv_cache_bytes": 2000, "max_num_seqs": 4, "max_loras": 1,
                                     "max_esft_adapters": 2}
    # 5600 bytes beside the batch's KV: e2 does not fit, one ESFT slot (e's) remains.
    split = plan_memory_split(profile, 6_000, items)
    assert (split.num_esft_slots, split.esft_bytes, split.kv_cache_bytes) == (1, 3000, 1000)
    # e does not fit either, but a kind with adapters gets one slot: what is left is KV for 2 requests.
    split = plan_memory_split(profile, 5_200, items[:2] + items[3:])
    assert (split.num_esft_slots, split.kv_cache_bytes, split.max_num_seqs) == (1, 200, 2)
    with pytest.raises(ValueError, match="one ESFT slot"):
        plan_memory_split(profile, 2_600, items[:2] + items[3:])


def test_budget_errors_and_the_one_slot_minimum():
    profile = make_profile()
    with pytest.raises(ValueError, match="one request"):
        plan_memory_split(profile, 50)
    with pytest.raises(ValueError, match="one LoRA slot"):
        plan_memory_split(profile, 500)
    split = plan_memory_split(profile, 1_200, measure=lambda n: 1.0)  # no room for a's slot in the search
    assert split.num_lora_slots == 1 and split.kv_cache_bytes == 200
    with pytest.raises(ValueError, match="not profiled"):
        plan_memory_split(profile, 10_000, [CacheItem("x", "expert", 0.5)])
