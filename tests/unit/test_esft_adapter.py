"""ESFT expert config parsing and validation (pure logic, no weights)."""

from __future__ import annotations

import json
import pickle
from pathlib import Path

import pytest

from elasticmoe.adapters.esft import EsftConfig
from elasticmoe.config import ModelConfig
from elasticmoe.errors import AdapterError

ESFT_DIR = Path("/work/shared/data/esft_expert_configs")
# max experts per layer of the four real DeepSeek-V2-Lite ESFT configs
REAL_MAX_EXPERTS = {"intent": 6, "law": 9, "summary": 8, "translation": 4}


def make_cfg(experts=None, **extra) -> dict:
    return {"experts": {"1": [3, 5]} if experts is None else experts, "shared_experts": False,
            "non_expert_modules": False, **extra}


def make_model_config(num_layers: int = 4, num_experts: int = 8, first_dense: int = 1) -> ModelConfig:
    return ModelConfig.from_hf_dict(dict(
        model_type="deepseek_v2", vocab_size=32, hidden_size=16, intermediate_size=32, moe_intermediate_size=8,
        num_hidden_layers=num_layers, num_attention_heads=2, n_routed_experts=num_experts, num_experts_per_tok=2,
        first_k_dense_replace=first_dense, kv_lora_rank=8, qk_rope_head_dim=4, qk_nope_head_dim=4, v_head_dim=4,
    ))


@pytest.mark.parametrize("obj, param", [
    ([1, 2], "experts"),
    ({"shared_experts": False}, "experts"),
    (make_cfg(experts=[[1, 2]]), "experts"),
    (make_cfg(experts={"one": [1]}), "experts"),
    (make_cfg(experts={"-1": [1]}), "experts"),
    (make_cfg(experts={"1": 3}), "experts"),
    (make_cfg(experts={"1": ["3"]}), "experts"),
    (make_cfg(experts={"1": [1.0]}), "experts"),
    (make_cfg(experts={"1": [True]}), "experts"),
    (make_cfg(experts={"1": [-2]}), "experts"),
    (make_cfg(shared_experts="no"), "shared_experts"),
    (make_cfg(non_expert_modules=1), "non_expert_modules"),
])
def test_bad_config_names_the_field(obj, param):
    with pytest.raises(AdapterError) as info:
        EsftConfig.from_json(obj)
    assert info.value.param == param
    assert str(info.value).startswith(f"{param}: ")


def test_parse_keeps_file_order_dedupes_and_sorts_layers():
    cfg = EsftConfig.from_json(make_cfg(experts={"10": [7, 2, 7, 1], "2": [5], "3": []}))
    assert cfg.experts == {2: (5,), 10: (7, 2, 1)}
    assert list(cfg.experts) == [2, 10]
    assert cfg.max_experts_per_layer == 3
    assert cfg.num_experts_total == 4
    assert EsftConfig.from_json(cfg.to_json()) == cfg
    assert json.loads(json.dumps(cfg.to_json()))["experts"] == {"2": [5], "10": [7, 2, 1]}


def test_direct_construction_is_validated():
    with pytest.raises(AdapterError, match="duplicate") as info:
        EsftConfig({1: (2, 2)})
    assert info.value.param == "experts"
    with pytest.raises(AdapterError):
        EsftConfig({1: ()})


@pytest.mark.parametrize("field", ["shared_experts", "non_expert_modules"])
def test_shared_or_non_expert_tuning_parses_but_is_unsupported(field):
    cfg = EsftConfig.from_json(make_cfg(**{field: True}))
    with pytest.raises(AdapterError, match="only routed experts are served") as info:
        cfg.check_supported()
    assert info.value.param == "path"
    EsftConfig.from_json(make_cfg()).check_supported()


@pytest.mark.parametrize("name", sorted(REAL_MAX_EXPERTS))
def test_real_esft_configs_parse(name):
    cfg = EsftConfig.from_file(ESFT_DIR / f"{name}.json")
    raw = json.loads((ESFT_DIR / f"{name}.json").read_text())
    assert cfg.max_experts_per_layer == REAL_MAX_EXPERTS[name]
    assert sorted(cfg.experts) == list(range(1, 27))  # DeepSeek-V2-Lite: layer 0 is dense
    assert cfg.num_experts_total == sum(len(set(v)) for v in raw["experts"].values())
    lite = make_model_config(num_layers=27, num_experts=64, first_dense=1)
    cfg.check_supported()
    cfg.check_fits(lite)


def test_check_fits_and_fitted_to():
    model = make_model_config(num_layers=4, num_experts=8, first_dense=1)  # MoE layers 1..3
    for experts in ({0: (1,)}, {4: (1,)}, {2: (8,)}):
        with pytest.raises(AdapterError) as info:
            EsftConfig(experts).check_fits(model)
        assert info.value.param == "experts"
    fitted = EsftConfig({0: (1,), 1: (9, 1, 17, 3), 3: (7,), 30: (2,)}).fitted_to(model)
    assert fitted.experts == {1: (1, 3), 3: (7,)}
    fitted.check_fits(model)


def test_from_file_errors_name_path(tmp_path):
    with pytest.raises(AdapterError) as info:
        EsftConfig.from_file(tmp_path / "missing.json")
    assert info.value.param == "path"
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(AdapterError) as info:
        EsftConfig.from_file(bad)
    assert info.value.param == "path"


def test_adapter_error_pickles_with_param():
    err = pickle.loads(pickle.dumps(AdapterError("experts", "layer 3 is a dense layer")))
    assert isinstance(err, AdapterError) and isinstance(err, ValueError)
    assert (err.param, err.message, str(err)) == ("experts", "layer 3 is a dense layer",
                                                  "experts: layer 3 is a dense layer")
