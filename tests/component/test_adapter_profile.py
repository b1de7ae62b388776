"""The offline profiler (CoServe §4.5) on the tiny Qwen3-MoE: it runs a real engine per adapter
kind and writes a profile the policies can load. Timings are not asserted (shared machine), only
what must hold whatever they are."""

from __future__ import annotations

from elasticmoe.adapter_policy.profile import load_profile
from elasticmoe.bench.adapter_profile import write_profile
from elasticmoe.config import ModelConfig


def test_profile_of_the_tiny_model(tiny_model_dir, tmp_path):
    budget = 4 << 20
    out = tmp_path / "profile.json"
    profile = write_profile(tiny_model_dir, out, batch_sizes=(1, 2, 4), output_len=2, repeats=1,
                            usage={"a": 0.6}, sample=["a", "b", "b", "c"], adapter_kinds={"c": "esft"},
                            budget_bytes=budget, num_threads=1)
    assert load_profile(out) == profile
    assert set(profile.kinds) == {"base", "lora", "esft", "expert"}
    for name, kind in profile.kinds.items():
        assert kind.max_batch in (1, 2, 4) and kind.k_s >= 0 and kind.b_s >= 0 and kind.load_s >= 0, name
    assert profile.kinds["base"].load_s == 0 and profile.kinds["base"].footprint_bytes == 0
    assert min(profile.kinds[k].load_s for k in ("lora", "esft", "expert")) > 0
    cfg = ModelConfig.from_pretrained(tiny_model_dir)
    # One expert's rows (w13 [2I, H] + w2 [H, I]) in fp32; an ESFT adapter of 2 experts per MoE layer.
    expert = 3 * cfg.moe_intermediate_size * cfg.hidden_size * 4
    assert profile.kinds["expert"].footprint_bytes == expert
    assert profile.kinds["esft"].footprint_bytes == 2 * len(cfg.moe_layer_ids) * expert
    assert profile.kinds["lora"].footprint_bytes > 0
    assert profile.kv_bytes_per_token == cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim * 4
    # The declaration wins over the sample's share; the others are their shares of the sample.
    assert profile.usage_probability == {"a": 0.6, "b": 0.5, "c": 0.25}
    assert profile.adapter_kind == {"a": "lora", "b": "lora", "c": "esft"}
    split = profile.memory_split
    assert split is not None and split.budget_bytes == budget and split.used_bytes <= budget
    assert 1 <= split.num_lora_slots <= 2 and split.kv_cache_bytes >= profile.request_kv_bytes
    # The ESFT adapter takes an ESFT slot (its rows), not a LoRA slot.
    assert split.num_esft_slots == 1 and split.esft_bytes == profile.kinds["esft"].footprint_bytes
    assert len(profile.meta["points"]["lora"]) == 3


def test_a_profile_for_slots_of_some_modules_sizes_them_and_carries_them(tiny_model_dir, tmp_path):
    """Slots of q_proj,v_proj are a fraction of full ones: the split fits more of them in the same
    budget, and says which modules they hold (`serve --profile` takes them)."""
    options = dict(batch_sizes=(1, 2), output_len=2, repeats=1, usage={"a": 0.5, "b": 0.3, "c": 0.2},
                   budget_bytes=4 << 20, num_threads=1)
    full = write_profile(tiny_model_dir, tmp_path / "full.json", **options)
    qv = write_profile(tiny_model_dir, tmp_path / "qv.json", lora_target_modules=("q_proj", "v_proj"), **options)
    assert qv.kinds["lora"].footprint_bytes * 5 < full.kinds["lora"].footprint_bytes
    assert full.memory_split is not None and qv.memory_split is not None
    assert full.memory_split.lora_target_modules is None
    assert qv.memory_split.lora_target_modules == ("q_proj", "v_proj") == load_profile(tmp_path / "qv.json").memory_split.lora_target_modules
    assert qv.memory_split.lora_slot_bytes == qv.kinds["lora"].footprint_bytes


def test_the_cli_names_kinds_and_refuses_malformed_pairs():
    import argparse

    import pytest

    from elasticmoe.bench.adapter_profile import _parse_kinds, _parse_usage, _target_modules

    assert _parse_kinds(["law=esft", "style=lora"]) == {"law": "esft", "style": "lora"}
    assert _parse_usage(["law=0.5"]) == {"law": 0.5}
    for bad, parse, message in ((["law"], _parse_kinds, "--kind: want NAME=lora|esft"),
                                (["law=dora"], _parse_kinds, r"--kind: \['law'\] want lora or esft"),
                                (["law=high"], _parse_usage, "--usage: law='high' is not a probability"),
                                (["=0.5"], _parse_usage, "--usage: want NAME=P")):
        with pytest.raises(argparse.ArgumentTypeError, match=message):
            parse(bad)
    assert _target_modules("q_proj, v_proj") == ("q_proj", "v_proj")
    with pytest.raises(argparse.ArgumentTypeError, match="--lora-target-modules: want distinct names"):
        _target_modules("q_proj,query")
