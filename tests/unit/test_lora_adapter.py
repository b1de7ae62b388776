"""PEFT LoRA config parsing and validation, scaling, adaptable modules (pure logic, no weights)."""

from __future__ import annotations

import json
import math
import pickle

import pytest

from elasticmoe.adapters.lora import LoraConfig, lora_modules
from elasticmoe.config import ModelConfig
from elasticmoe.errors import AdapterError


def make_cfg(**extra) -> dict:
    """A PEFT adapter_config.json as PEFT writes it."""
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": 8, "lora_alpha": 16,
            "target_modules": ["q_proj", "v_proj"], "lora_dropout": 0.05, "bias": "none", "use_rslora": False,
            "fan_in_fan_out": False, "modules_to_save": None, "rank_pattern": {}, "alpha_pattern": {},
            "use_dora": False, "layers_to_transform": None, "init_lora_weights": True, **extra}


def make_model_config(arch: str, **extra) -> ModelConfig:
    common = dict(model_type=arch, vocab_size=32, hidden_size=16, intermediate_size=24, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, num_experts_per_tok=2)
    if arch == "qwen3_moe":
        return ModelConfig.from_hf_dict({**common, "num_experts": 4, "moe_intermediate_size": 8, **extra})
    if arch == "mixtral":
        return ModelConfig.from_hf_dict({**common, "num_local_experts": 4, **extra})
    return ModelConfig.from_hf_dict({
        **common, "num_key_value_heads": 4, "n_routed_experts": 4, "moe_intermediate_size": 8,
        "first_k_dense_replace": 1, "kv_lora_rank": 8, "qk_rope_head_dim": 2, "qk_nope_head_dim": 4,
        "v_head_dim": 6, **extra,
    })


def test_parses_peft_config():
    cfg = LoraConfig.from_json(make_cfg(target_modules=["q_proj", "v_proj", "q_proj"], layers_to_transform=1))
    assert (cfg.r, cfg.lora_alpha, cfg.target_modules, cfg.use_rslora) == (8, 16, ("q_proj", "v_proj"), False)
    assert cfg.layers_to_transform == (1,)
    minimal = {"peft_type": "LORA", "r": 4, "lora_alpha": 8.0, "target_modules": ["w1"]}
    assert LoraConfig.from_json(minimal) == LoraConfig(4, 8.0, ("w1",))


@pytest.mark.parametrize("obj, param", [
    ([1], "path"),
    (make_cfg(peft_type="LOHA"), "peft_type"),
    (make_cfg(peft_type=None), "peft_type"),
    (make_cfg(r=0), "r"),
    (make_cfg(r=2.0), "r"),
    (make_cfg(r=True), "r"),
    (make_cfg(r=None), "r"),
    (make_cfg(lora_alpha=0), "lora_alpha"),
    (make_cfg(lora_alpha="16"), "lora_alpha"),
    (make_cfg(lora_alpha=float("inf")), "lora_alpha"),
    (make_cfg(bias="all"), "bias"),
    (make_cfg(bias="lora_only"), "bias"),
    (make_cfg(modules_to_save=["lm_head"]), "modules_to_save"),
    (make_cfg(rank_pattern={"q_proj": 4}), "rank_pattern"),
    (make_cfg(alpha_pattern={"q_proj": 4}), "alpha_pattern"),
    (make_cfg(fan_in_fan_out=True), "fan_in_fan_out"),
    (make_cfg(use_dora=True), "use_dora"),
    (make_cfg(lora_bias=True), "lora_bias"),
    (make_cfg(target_parameters=["mlp.experts.gate_up_proj"]), "target_parameters"),
    (make_cfg(use_rslora="yes"), "use_rslora"),
    (make_cfg(target_modules=[]), "target_modules"),
    (make_cfg(target_modules="all-linear"), "target_modules"),
    (make_cfg(target_modules=".*q_proj"), "target_modules"),
    (make_cfg(target_modules=["q_proj", "lm_head"]), "target_modules"),
    (make_cfg(target_modules=["gate"]), "target_modules"),
    (make_cfg(target_modules=[3]), "target_modules"),
    (make_cfg(layers_to_transform="0"), "layers_to_transform"),
    (make_cfg(layers_to_transform=[-1]), "layers_to_transform"),
])
def test_bad_config_names_the_field(obj, param):
    with pytest.raises(AdapterError) as info:
        LoraConfig.from_json(obj)
    assert info.value.param == param


def test_from_file_errors_name_path(tmp_path):
    with pytest.raises(AdapterError) as info:
        LoraConfig.from_file(tmp_path / "missing.json")
    assert info.value.param == "path"
    (tmp_path / "bad.json").write_text("{")
    with pytest.raises(AdapterError) as info:
        LoraConfig.from_file(tmp_path / "bad.json")
    assert info.value.param == "path"
    (tmp_path / "ok.json").write_text(json.dumps(make_cfg()))
    assert LoraConfig.from_file(tmp_path / "ok.json").r == 8


@pytest.mark.parametrize("r, alpha, rslora, want", [
    (8, 16, False, 2.0), (16, 16, False, 1.0), (4, 32, False, 8.0),
    (16, 16, True, 4.0), (8, 16, True, 16 / math.sqrt(8)), (1, 3.5, True, 3.5),
])
def test_scaling(r, alpha, rslora, want):
    cfg = LoraConfig.from_json(make_cfg(r=r, lora_alpha=alpha, use_rslora=rslora))
    assert cfg.scaling == pytest.approx(want)


def test_to_json_round_trips_and_is_peft_shaped():
    cfg = LoraConfig(4, 8.0, ("q_proj", "down_proj"), use_rslora=True, layers_to_transform=(0, 2))
    obj = cfg.to_json("base/dir")
    assert obj["peft_type"] == "LORA" and obj["bias"] == "none" and obj["modules_to_save"] is None
    assert obj["fan_in_fan_out"] is False and obj["base_model_name_or_path"] == "base/dir"
    assert LoraConfig.from_json(json.loads(json.dumps(obj))) == cfg


def test_config_and_error_pickle():
    cfg = LoraConfig.from_json(make_cfg(use_rslora=True))
    assert pickle.loads(pickle.dumps(cfg)) == cfg
    err = pickle.loads(pickle.dumps(AdapterError("target_modules", "nope")))
    assert (err.param, err.message) == ("target_modules", "nope")


@pytest.mark.parametrize("arch, good, bad", [
    ("qwen3_moe", ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
     ["w1", "w2", "w3", "q_a_proj", "kv_b_proj"]),
    ("mixtral", ["q_proj", "k_proj", "v_proj", "o_proj", "w1", "w2", "w3"],
     ["gate_proj", "up_proj", "down_proj", "kv_a_proj_with_mqa"]),
    ("deepseek_v2", ["q_proj", "kv_a_proj_with_mqa", "o_proj", "gate_proj", "up_proj", "down_proj"],
     ["k_proj", "v_proj", "q_a_proj", "q_b_proj", "w1", "kv_b_proj"]),
])
def test_check_fits_allows_only_the_base_models_modules(arch, good, bad):
    model = make_model_config(arch)
    LoraConfig(8, 16, tuple(good)).check_fits(model)
    for name in bad:
        with pytest.raises(AdapterError) as info:
            LoraConfig(8, 16, ("q_proj", name)).check_fits(model)
        assert info.value.param == "target_modules" and name in str(info.value)


def test_lora_modules_shapes():
    qwen = lora_modules(make_model_config("qwen3_moe"))  # head_dim 4, 4 heads, 2 kv heads
    assert qwen["model.layers.1.self_attn.q_proj"] == (16, 16)
    assert qwen["model.layers.1.self_attn.k_proj"] == (16, 8)
    assert qwen["model.layers.0.mlp.experts.3.gate_proj"] == (16, 8)
    assert qwen["model.layers.0.mlp.experts.3.down_proj"] == (8, 16)
    assert len(qwen) == 2 * 4 + 2 * 4 * 3
    mixtral = lora_modules(make_model_config("mixtral"))
    assert mixtral["model.layers.0.block_sparse_moe.experts.1.w2"] == (24, 16)
    assert mixtral["model.layers.0.block_sparse_moe.experts.1.w3"] == (16, 24)
    ds = lora_modules(make_model_config("deepseek_v2"))
    assert ds["model.layers.0.self_attn.q_proj"] == (16, 4 * 6)
    assert ds["model.layers.0.self_attn.kv_a_proj_with_mqa"] == (16, 10)
    assert "model.layers.0.self_attn.kv_b_proj" not in ds  # absorbed into MLA: not adaptable
    assert ds["model.layers.0.self_attn.o_proj"] == (24, 16)
    assert not any(".mlp." in m for m in ds if m.startswith("model.layers.0."))  # dense layer: not adaptable
    assert "model.layers.1.mlp.experts.3.up_proj" in ds
    ds_qlora = lora_modules(make_model_config("deepseek_v2", q_lora_rank=12))
    assert ds_qlora["model.layers.1.self_attn.q_a_proj"] == (16, 12)
    assert ds_qlora["model.layers.1.self_attn.q_b_proj"] == (12, 24)
    assert "model.layers.1.self_attn.q_proj" not in ds_qlora
    LoraConfig(8, 16, ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "o_proj")).check_fits(
        make_model_config("deepseek_v2", q_lora_rank=12))


def test_mla_kv_b_proj_is_rejected_with_the_reason():
    with pytest.raises(AdapterError) as info:
        LoraConfig(8, 16, ("q_proj", "kv_b_proj")).check_fits(make_model_config("deepseek_v2"))
    assert info.value.param == "target_modules"
    assert "kv_b_proj cannot be adapted" in info.value.message and "cached" in info.value.message
