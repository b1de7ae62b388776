"""The offline profile (CoServe §4.5): validation, JSON round trip, and the fits that fill it."""

from __future__ import annotations

import json

import pytest

from elasticmoe.adapter_policy.fitting import linear_fit, plateau_batch
from elasticmoe.adapter_policy.profile import KindProfile, MemorySplit, Profile, load_profile


def make_profile(**overrides) -> Profile:
    fields = dict(
        model="models/tiny", device="cpu",
        kinds={"base": KindProfile(8, 0.01, 0.05), "lora": KindProfile(8, 0.012, 0.06, 0.002, 4096)},
        kv_bytes_per_token=128, tokens_per_request=32,
        usage_probability={"a": 0.6, "b": 0.3}, adapter_kind={"a": "lora", "b": "lora"},
        memory_split=MemorySplit(1 << 20, 1 << 19, 4, 4096, strategy="limited", max_num_seqs=8,
                                 lora_target_modules=("q_proj", "v_proj")),
        meta={"torch": "2.13"},
    )
    return Profile(**{**fields, **overrides})


def test_json_round_trip_and_files(tmp_path):
    profile = make_profile()
    assert Profile.from_json(json.loads(json.dumps(profile.to_json()))) == profile
    path = profile.save(tmp_path / "sub" / "profile.json")
    assert load_profile(path) == profile
    assert profile.request_kv_bytes == 128 * 32
    assert profile.kind_of("a") == "lora" and profile.kind_of(None) == "base" and profile.kind_of("new") == "lora"


def test_load_profile_names_the_file_and_what_is_wrong(tmp_path):
    with pytest.raises(ValueError, match="cannot read"):
        load_profile(tmp_path / "missing.json")
    bad = tmp_path / "bad.json"
    bad.write_text("[1]")
    with pytest.raises(ValueError, match="JSON object"):
        load_profile(bad)
    bad.write_text(json.dumps({**make_profile().to_json(), "version": 99}))
    with pytest.raises(ValueError, match="version"):
        load_profile(bad)
    obj = make_profile().to_json()
    del obj["kinds"]
    bad.write_text(json.dumps(obj))
    with pytest.raises(ValueError, match=f"{bad}.*malformed"):
        load_profile(bad)


def test_validation():
    with pytest.raises(ValueError, match="base"):
        make_profile(kinds={"lora": KindProfile(1, 0.0, 0.0)})
    with pytest.raises(ValueError, match="not profiled"):
        make_profile(adapter_kind={"e": "esft"})
    with pytest.raises(ValueError, match="usage_probability"):
        make_profile(usage_probability={"a": 3.0})
    with pytest.raises(ValueError, match="max_batch"):
        KindProfile(0, 0.1, 0.1)
    with pytest.raises(ValueError, match="k_s"):
        KindProfile(1, float("nan"), 0.1)
    with pytest.raises(ValueError, match="budget"):
        MemorySplit(100, 90, 1, 20)
    assert KindProfile(4, 0.5, 2.0).batch_latency(3) == pytest.approx(3.5)


def test_memory_split_parts_and_engine_fields():
    split = MemorySplit(1000, 500, 3, 100, num_expert_rows=2, expert_row_bytes=50, esft_bytes=100, max_num_seqs=6)
    assert (split.lora_bytes, split.expert_cache_bytes, split.used_bytes) == (300, 100, 1000)
    assert split.engine_fields() == {"kv_cache_bytes": 500, "max_num_seqs": 6, "max_loras": 3}
    assert "max_loras" not in MemorySplit(1000, 500, 0, 100).engine_fields()
    # The slots' modules go with their count (their bytes sized it), and only with it.
    targeted = MemorySplit(1000, 500, 3, 100, lora_target_modules=("q_proj",))
    assert targeted.engine_fields()["lora_target_modules"] == ("q_proj",)
    assert "lora_target_modules" not in MemorySplit(1000, 500, 0, 100, lora_target_modules=("q_proj",)).engine_fields()


def test_linear_fit_recovers_k_and_b():
    k, b = linear_fit([1, 2, 4, 8], [0.07, 0.09, 0.13, 0.21])  # 0.02 n + 0.05
    assert (k, b) == (pytest.approx(0.02), pytest.approx(0.05))
    assert linear_fit([3], [5.0]) == (0.0, 5.0)
    with pytest.raises(ValueError):
        linear_fit([1, 2], [1.0])


def test_max_batch_is_where_the_average_latency_plateaus():
    # Average latency per request: 1.0, 0.6, 0.4, 0.39, 0.385 -> stops falling by 5 % after 4.
    points = [(1, 1.0), (2, 1.2), (4, 1.6), (8, 3.12), (16, 6.16)]
    assert plateau_batch(points) == 4
    assert plateau_batch([(1, 1.0), (2, 1.0), (4, 1.0)]) == 4  # still falling: the largest measured
    # A disturbed run at 4 (average 0.6 after 0.5) does not end the curve: 8 still halves it.
    assert plateau_batch([(1, 1.0), (2, 1.0), (4, 2.4), (8, 1.6)]) == 8
    assert plateau_batch([(2, 1.0)]) == 2
    with pytest.raises(ValueError):
        plateau_batch([])
