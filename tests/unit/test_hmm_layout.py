from __future__ import annotations

import math
from pathlib import Path

import pytest
from hmm_factories import D, X, make_devices, make_sizes
from safetensors import safe_open

from elasticmoe.config import ModelConfig
from elasticmoe.models.registry import model_family
from elasticmoe.parallel.expert_placement import ExpertPlacement
from hmm.layout import DeviceSpec, Layout, ModelSizes, TensorKey, layout_for


def test_keys_and_devices_validate():
    assert TensorKey.dense("layers.3.attn.qkv").layer == 3
    assert TensorKey.dense("embed").layer is None
    with pytest.raises(ValueError):
        TensorKey("expert", "layers.0.moe.w13", 0, None)
    with pytest.raises(ValueError):
        TensorKey("kv", "pool")
    with pytest.raises(ValueError):
        DeviceSpec(0, 0, 0)


def test_layout_replicates_dense_places_experts_and_sizes_kv():
    sizes = make_sizes()
    lay = layout_for(None, sizes, make_devices(4), dp=3, ep=3)
    assert lay.device_ids == (0, 1, 2)  # uses devices 0..dp-1
    assert [len(lay.local_experts(d)) for d in lay.device_ids] == [11, 11, 10]
    for d in lay.device_ids:
        t = lay.tensors(d)
        assert {k.name for k in t if k.kind == "dense"} == {n for n, _ in sizes.dense}
        assert t[TensorKey.expert_row("layers.1.moe.w2", 1, lay.local_experts(d)[0])] == 100
        # KV pool = budget - weights: 100000 - (11000 + 11*600) = 82400 on devices 0, 1.
        assert t[TensorKey.kv()] == (82_400 if d < 2 else 83_000)
        assert lay.total_bytes(d) == 100_000
    assert lay.holder(11) == 1 and lay.slot(11) == 0


def test_layout_rejects_what_does_not_fit():
    with pytest.raises(ValueError, match="exceed"):
        layout_for(None, make_sizes(), make_devices(1, budget=D + 32 * X - 1), dp=1, ep=1)
    with pytest.raises(ValueError, match="exceed"):
        layout_for(None, make_sizes(), make_devices(2), dp=2, ep=2, kv_bytes=100_000 - D - 16 * X + 1)
    with pytest.raises(ValueError, match="ep must be dp"):  # ep = 1 (replicated experts) is a layout too
        layout_for(None, make_sizes(), make_devices(4), dp=4, ep=2)
    with pytest.raises(ValueError, match="placement"):
        Layout(make_sizes(), tuple(make_devices(2)), ExpertPlacement.balanced(32, 3), (0, 0))


def test_sizes_from_real_checkpoint_param_specs(tiny_model_dir):
    cfg = ModelConfig.from_pretrained(tiny_model_dir)
    specs = model_family(cfg.arch).param_specs(cfg, tuple(range(cfg.num_experts)))
    sizes = ModelSizes.from_specs(specs, cfg.num_experts, dtype_bytes=2)
    # One bf16 expert: w13 [2I, H] + w2 [H, I] per MoE layer.
    h, i = cfg.hidden_size, cfg.moe_intermediate_size
    assert sizes.expert_bytes == len(cfg.moe_layer_ids) * (2 * i * h + h * i) * 2
    # Oracle: the checkpoint holds exactly the elements the specs assemble.
    numel = 0
    for path in Path(tiny_model_dir).glob("*.safetensors"):
        with safe_open(str(path), framework="pt") as f:
            numel += sum(math.prod(f.get_slice(n).get_shape()) for n in f.keys())
    assert sizes.weight_bytes(cfg.num_experts) == numel * 2
    lay = layout_for(
        cfg, specs, make_devices(2, budget=10 * sizes.weight_bytes(8)), dp=2, ep=2, dtype_bytes=2
    )
    assert lay.weight_bytes(0) == sizes.dense_bytes + 4 * sizes.expert_bytes
