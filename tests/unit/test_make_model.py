import json
from pathlib import Path

from safetensors import safe_open

from elasticmoe.config import ModelConfig


def test_checkpoints_have_real_names_and_config(tiny_model_dirs):
    expected = {
        "qwen3_moe": "model.layers.1.mlp.experts.0.gate_proj.weight",
        "mixtral": "model.layers.1.block_sparse_moe.experts.0.w1.weight",
        "deepseek_v2": "model.layers.1.mlp.shared_experts.gate_proj.weight",
    }
    for arch, path in tiny_model_dirs.items():
        d = Path(path)
        for f in ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"):
            assert (d / f).is_file(), f
        assert "chat_template" in json.loads((d / "tokenizer_config.json").read_text())
        with safe_open(str(d / "model.safetensors"), "pt") as f:
            assert expected[arch] in f.keys()
        cfg = ModelConfig.from_pretrained(d)
        assert cfg.arch == arch
        assert cfg.eos_token_ids


def test_deepseek_config_parsing(tiny_model_dirs):
    cfg = ModelConfig.from_pretrained(tiny_model_dirs["deepseek_v2"])
    assert cfg.moe_layer_ids == (1, 2)
    assert cfg.is_mla and cfg.topk_method == "group_limited_greedy"
    assert cfg.num_shared_experts == 2
