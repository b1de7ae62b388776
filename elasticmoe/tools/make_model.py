"""`elasticmoe make-model`: write a randomly initialised HF checkpoint of a real
MoE architecture (config.json, safetensors, generation_config.json, tokenizer).

The model is built with `transformers`' own config and model classes, so tensor
names and config keys are exactly those of real checkpoints.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer

from elasticmoe.tools.tokenizer_builder import EOS_TOKEN, PAD_TOKEN, build_tokenizer, save_tokenizer

logger = logging.getLogger(__name__)

# Per (arch, preset): transformers config kwargs. `tiny` loads in well under a
# second for tests; `small` is the benchmark model (~110M parameters for qwen3_moe);
# `tiny-vllm` is `tiny` with head_dim 32, the smallest vLLM's CPU attention supports.
PRESETS: dict[str, dict[str, dict]] = {
    "qwen3_moe": {
        "tiny": dict(vocab_size=512, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                     num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                     num_experts=8, num_experts_per_tok=2, norm_topk_prob=True, max_position_embeddings=2048),
        "tiny-vllm": dict(vocab_size=512, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                          num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                          num_experts=8, num_experts_per_tok=2, norm_topk_prob=True, max_position_embeddings=2048),
        "small": dict(vocab_size=4096, hidden_size=512, intermediate_size=1536, moe_intermediate_size=256,
                      num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=2, head_dim=64,
                      num_experts=32, num_experts_per_tok=4, norm_topk_prob=True, max_position_embeddings=4096),
    },
    "mixtral": {
        "tiny": dict(vocab_size=512, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
                     max_position_embeddings=2048),
        "small": dict(vocab_size=4096, hidden_size=512, intermediate_size=512, num_hidden_layers=8,
                      num_attention_heads=8, num_key_value_heads=2, num_local_experts=8, num_experts_per_tok=2,
                      max_position_embeddings=4096),
    },
    "deepseek_v2": {
        # q_lora_rank=None and a dense first layer, as in DeepSeek-V2-Lite.
        "tiny": dict(vocab_size=512, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                     num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8,
                     n_shared_experts=2, num_experts_per_tok=2, first_k_dense_replace=1, kv_lora_rank=32,
                     q_lora_rank=None, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16, n_group=4,
                     topk_group=2, topk_method="group_limited_greedy", routed_scaling_factor=1.5,
                     max_position_embeddings=2048),
        "small": dict(vocab_size=4096, hidden_size=512, intermediate_size=1536, moe_intermediate_size=256,
                      num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=8, n_routed_experts=32,
                      n_shared_experts=2, num_experts_per_tok=4, first_k_dense_replace=1, kv_lora_rank=128,
                      q_lora_rank=None, qk_rope_head_dim=32, qk_nope_head_dim=64, v_head_dim=64, n_group=8,
                      topk_group=4, topk_method="group_limited_greedy", routed_scaling_factor=1.0,
                      max_position_embeddings=4096),
    },
}

# Larger than transformers' default (0.02) so that logits are not near-uniform
# and greedy decoding is not decided by rounding noise.
_INIT_STD = {"tiny": 0.08, "tiny-vllm": 0.08, "small": 0.04}
_SAVE_DTYPE = {"tiny": "float32", "tiny-vllm": "float32", "small": "bfloat16"}  # torch dtype names
# NOTE: torch is imported where a model is built: the CLI's parser reads PRESETS (`elasticmoe
# --help` builds every command's), and would pay ~2 CPU-s for it.


def save_dtype(preset: str) -> Any:
    """The torch dtype a checkpoint of `preset` is stored in."""
    import torch

    return getattr(torch, _SAVE_DTYPE[preset])


def _classes(arch: str):
    import transformers as tf

    return {
        "qwen3_moe": (tf.Qwen3MoeConfig, tf.Qwen3MoeForCausalLM),
        "mixtral": (tf.MixtralConfig, tf.MixtralForCausalLM),
        "deepseek_v2": (tf.DeepseekV2Config, tf.DeepseekV2ForCausalLM),
    }[arch]


def build_model(arch: str, preset: str, tok: Tokenizer, seed: int) -> Any:
    """The randomly initialised `transformers` model of (arch, preset) for tokenizer `tok`, in
    float32, with its generation config (greedy, the tokenizer's end token)."""
    import torch
    from transformers import GenerationConfig

    eos_id, pad_id = tok.token_to_id(EOS_TOKEN), tok.token_to_id(PAD_TOKEN)
    config_cls, model_cls = _classes(arch)
    config = config_cls(**PRESETS[arch][preset], initializer_range=_INIT_STD[preset], eos_token_id=eos_id,
                        pad_token_id=pad_id, bos_token_id=None, tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = model_cls(config)
    model.generation_config = GenerationConfig(eos_token_id=[eos_id], pad_token_id=pad_id, do_sample=False)
    return model


def make_model(arch: str, preset: str, seed: int, out: str) -> Path:
    if arch not in PRESETS:
        raise ValueError(f"arch: expected one of {sorted(PRESETS)}, got {arch!r}")
    if preset not in PRESETS[arch]:
        raise ValueError(f"preset: expected one of {sorted(PRESETS[arch])}, got {preset!r}")
    out_dir = Path(out)
    out_dir.mkdir(parents=True, exist_ok=True)
    tok = build_tokenizer(vocab_size=PRESETS[arch][preset]["vocab_size"], seed=seed)
    logger.info("building %s/%s with transformers (seed %d)", arch, preset, seed)
    model = build_model(arch, preset, tok, seed).to(save_dtype(preset)).eval()
    model.save_pretrained(out_dir)
    save_tokenizer(tok, str(out_dir))
    num_params = sum(p.numel() for p in model.parameters())
    logger.info("wrote %s (%.1fM parameters)", out_dir, num_params / 1e6)
    return out_dir
