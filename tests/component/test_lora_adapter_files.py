"""PEFT LoRA adapter files on tiny real-architecture checkpoints: make, open, validate,
merge (the merged model is the oracle for LoRA serving), and the CLI."""

from __future__ import annotations

import json
import pickle
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from elasticmoe.adapters.lora import CONFIG_FILE, PREFIX, WEIGHTS_FILE, LoraAdapter, lora_modules
from elasticmoe.cli import main
from elasticmoe.config import ModelConfig
from elasticmoe.errors import AdapterError
from elasticmoe.tools.make_lora_adapter import make_lora_adapter, write_lora_merged_model

# arch -> (targets, layers, experts): attention everywhere plus expert targets on a subset
SPECS = {
    "qwen3_moe": (("q_proj", "v_proj", "down_proj", "up_proj"), None, (0, 3)),
    "mixtral": (("o_proj", "k_proj", "w1", "w2"), (1,), (2,)),
    "deepseek_v2": (("q_proj", "kv_a_proj_with_mqa", "o_proj", "gate_proj"), (1, 2), (5,)),
}
ARCHS = tuple(SPECS)


@pytest.fixture(scope="module")
def adapters(tiny_model_dirs, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("lora")
    return {arch: make_lora_adapter(tiny_model_dirs[arch], root / arch, rank=4, alpha=8, target_modules=targets,
                                    layers=layers, experts=experts, seed=1)
            for arch, (targets, layers, experts) in SPECS.items()}


def base_tensors(model_dir: str | Path) -> dict[str, torch.Tensor]:
    return load_file(str(Path(model_dir) / "model.safetensors"))


def expected_modules(cfg: ModelConfig, arch: str) -> set[str]:
    targets, layers, experts = SPECS[arch]
    out = set()
    for module in lora_modules(cfg):
        parts = module.split(".")
        if parts[-1] not in targets or (layers is not None and int(parts[2]) not in layers):
            continue
        if "experts" in parts and int(parts[parts.index("experts") + 1]) not in experts:
            continue
        out.add(module)
    return out


@pytest.mark.parametrize("arch", ARCHS)
def test_lora_modules_match_checkpoint_shapes(arch, tiny_model_dirs):
    cfg = ModelConfig.from_pretrained(tiny_model_dirs[arch])
    base = base_tensors(tiny_model_dirs[arch])
    for module, (in_features, out_features) in lora_modules(cfg).items():
        assert base[f"{module}.weight"].shape == (out_features, in_features), module


@pytest.mark.parametrize("arch", ARCHS)
def test_open_lists_exactly_the_adapted_modules_and_delta_matches_file(arch, tiny_model_dirs, adapters):
    cfg = ModelConfig.from_pretrained(tiny_model_dirs[arch])
    adapter = LoraAdapter.open("a", adapters[arch], cfg, max_rank=4, base_dir=tiny_model_dirs[arch])
    want = expected_modules(cfg, arch)
    assert set(adapter.modules) == want
    assert any("experts" in m for m in want) and any("self_attn" in m for m in want)
    assert adapter.config.scaling == 2.0
    raw = load_file(str(adapters[arch] / WEIGHTS_FILE))
    assert set(raw) == {f"{PREFIX}{m}.lora_{x}.weight" for m in want for x in "AB"}
    base = base_tensors(tiny_model_dirs[arch])
    shapes = lora_modules(cfg)
    for module, (r, in_features, out_features) in adapter.modules.items():
        assert (r, in_features, out_features) == (4, *shapes[module])
        a, b = raw[f"{PREFIX}{module}.lora_A.weight"], raw[f"{PREFIX}{module}.lora_B.weight"]
        assert a.dtype == torch.float32 and a.shape == (4, in_features) and b.shape == (out_features, 4)
        got_a, got_b = adapter.weights(module)
        assert torch.equal(got_a, a) and torch.equal(got_b, b)
        assert adapter.weights(module, torch.bfloat16)[0].dtype == torch.bfloat16
        delta = adapter.delta(module)
        assert torch.allclose(delta, 2.0 * b @ a)
        ratio = (delta.norm() / base[f"{module}.weight"].norm()).item()
        assert 0.05 < ratio < 0.6, (module, ratio)  # visible but moderate
    assert adapter.nbytes() == sum(4 * (i + o) * 4 for _, i, o in adapter.modules.values())
    assert adapter.nbytes(torch.bfloat16) * 2 == adapter.nbytes()
    with pytest.raises(KeyError):
        adapter.weights("model.layers.0.self_attn.q_norm")


def test_adapter_pickles(tiny_model_dir, adapters):
    cfg = ModelConfig.from_pretrained(tiny_model_dir)
    adapter = LoraAdapter.open("a", adapters["qwen3_moe"], cfg)
    module = next(iter(adapter.modules))
    before = adapter.delta(module)  # opens the file handle
    clone = pickle.loads(pickle.dumps(adapter))
    assert clone.modules == adapter.modules and clone.config == adapter.config
    assert torch.equal(clone.delta(module), before)


def test_same_seed_same_adapter_and_rslora(tiny_model_dir, adapters, tmp_path):
    targets, layers, experts = SPECS["qwen3_moe"]
    again = make_lora_adapter(tiny_model_dir, tmp_path / "again", rank=4, alpha=8, target_modules=targets,
                              layers=layers, experts=experts, seed=1)
    first, second = load_file(str(adapters["qwen3_moe"] / WEIGHTS_FILE)), load_file(str(again / WEIGHTS_FILE))
    assert all(torch.equal(first[k], second[k]) for k in first)
    other = load_file(str(make_lora_adapter(tiny_model_dir, tmp_path / "other", seed=2) / WEIGHTS_FILE))
    cfg = ModelConfig.from_pretrained(tiny_model_dir)
    rs = LoraAdapter.open("rs", make_lora_adapter(tiny_model_dir, tmp_path / "rs", rank=4, alpha=8,
                                                  use_rslora=True), cfg)
    assert rs.config.use_rslora and rs.config.scaling == 4.0
    assert set(other) == {f"{PREFIX}model.layers.{i}.self_attn.{p}.lora_{x}.weight"
                          for i in range(cfg.num_layers) for p in ("q_proj", "v_proj") for x in "AB"}
    written = json.loads((again / CONFIG_FILE).read_text())
    assert written["peft_type"] == "LORA" and written["task_type"] == "CAUSAL_LM" and written["bias"] == "none"
    assert written["lora_dropout"] == 0.0 and written["modules_to_save"] is None and not written["fan_in_fan_out"]
    assert written["base_model_name_or_path"] == tiny_model_dir


def _edit_tensors(adapter_dir: Path, edit) -> None:
    tensors = load_file(str(adapter_dir / WEIGHTS_FILE))
    edit(tensors)
    save_file(tensors, str(adapter_dir / WEIGHTS_FILE))


def _edit_cfg(adapter_dir: Path, edit) -> None:
    obj = json.loads((adapter_dir / CONFIG_FILE).read_text())
    edit(obj)
    (adapter_dir / CONFIG_FILE).write_text(json.dumps(obj))


Q0 = f"{PREFIX}model.layers.0.self_attn.q_proj"
TAMPERS = {
    "missing B": ("path", "no lora_B", lambda d: _edit_tensors(d, lambda t: t.pop(f"{Q0}.lora_B.weight"))),
    "missing A": ("path", "no lora_A", lambda d: _edit_tensors(d, lambda t: t.pop(f"{Q0}.lora_A.weight"))),
    "wrong in": ("path", "do not fit", lambda d: _edit_tensors(
        d, lambda t: t.update({f"{Q0}.lora_A.weight": torch.zeros(4, 63)}))),
    "wrong out": ("path", "do not fit", lambda d: _edit_tensors(
        d, lambda t: t.update({f"{Q0}.lora_B.weight": torch.zeros(32, 4)}))),
    "rank mismatch": ("r", "rank", lambda d: _edit_tensors(
        d, lambda t: t.update({f"{Q0}.lora_A.weight": torch.zeros(3, 64), f"{Q0}.lora_B.weight": torch.zeros(64, 3)}))),
    "unknown module": ("path", "not an adaptable module", lambda d: _edit_tensors(
        d, lambda t: t.update({f"{PREFIX}model.layers.0.self_attn.x_proj.lora_A.weight": torch.zeros(4, 64)}))),
    "layer out of range": ("path", "not an adaptable module", lambda d: _edit_tensors(
        d, lambda t: t.update({f"{PREFIX}model.layers.9.self_attn.q_proj.lora_A.weight": torch.zeros(4, 64)}))),
    "untargeted module": ("target_modules", "not in", lambda d: _edit_tensors(
        d, lambda t: t.update({f"{PREFIX}model.layers.0.self_attn.k_proj.lora_A.weight": torch.zeros(4, 64),
                               f"{PREFIX}model.layers.0.self_attn.k_proj.lora_B.weight": torch.zeros(32, 4)}))),
    "adapter name in key": ("path", "unexpected tensor", lambda d: _edit_tensors(
        d, lambda t: t.update({f"{Q0}.lora_A.default.weight": t.pop(f"{Q0}.lora_A.weight")}))),
    "no prefix": ("path", "unexpected tensor", lambda d: _edit_tensors(
        d, lambda t: t.update({"model.layers.0.self_attn.q_proj.lora_A.weight": t.pop(f"{Q0}.lora_A.weight")}))),
    "dora magnitude": ("path", "unexpected tensor", lambda d: _edit_tensors(
        d, lambda t: t.update({f"{Q0}.lora_magnitude_vector": torch.ones(64)}))),
    "empty": ("path", "no LoRA tensors", lambda d: save_file({}, str(d / WEIGHTS_FILE))),
    "no weights file": ("path", WEIGHTS_FILE, lambda d: (d / WEIGHTS_FILE).unlink()),
    "no config": ("path", CONFIG_FILE, lambda d: (d / CONFIG_FILE).unlink()),
    "corrupt weights": ("path", "cannot read", lambda d: (d / WEIGHTS_FILE).write_bytes(b"garbage")),
    "target of another arch": ("target_modules", "w1", lambda d: _edit_cfg(
        d, lambda c: c["target_modules"].append("w1"))),
    "bias": ("bias", "none", lambda d: _edit_cfg(d, lambda c: c.update(bias="all"))),
    "outside layers_to_transform": ("layers_to_transform", "outside", lambda d: _edit_cfg(
        d, lambda c: c.update(layers_to_transform=[1]))),
}


@pytest.mark.parametrize("case", sorted(TAMPERS))
def test_tampered_adapter_is_rejected(case, tiny_model_dir, adapters, tmp_path):
    param, words, tamper = TAMPERS[case]
    adapter_dir = Path(shutil.copytree(adapters["qwen3_moe"], tmp_path / "adapter"))
    LoraAdapter.open("ok", adapter_dir, ModelConfig.from_pretrained(tiny_model_dir))  # valid before tampering
    tamper(adapter_dir)
    with pytest.raises(AdapterError) as info:
        LoraAdapter.open("bad", adapter_dir, ModelConfig.from_pretrained(tiny_model_dir))
    assert info.value.param == param and words in str(info.value), str(info.value)


def test_rank_above_max_rank_is_rejected(tiny_model_dir, adapters):
    cfg = ModelConfig.from_pretrained(tiny_model_dir)
    assert LoraAdapter.open("a", adapters["qwen3_moe"], cfg, max_rank=4).config.r == 4
    with pytest.raises(AdapterError) as info:
        LoraAdapter.open("a", adapters["qwen3_moe"], cfg, max_rank=3)
    assert info.value.param == "r" and "maximum rank 3" in str(info.value)


def test_shared_expert_and_dense_mlp_are_not_adaptable(tiny_model_dirs, adapters, tmp_path):
    adapter_dir = Path(shutil.copytree(adapters["deepseek_v2"], tmp_path / "adapter"))
    cfg = ModelConfig.from_pretrained(tiny_model_dirs["deepseek_v2"])
    for module, shape in (("model.layers.1.mlp.shared_experts.gate_proj", (64, 64)),
                          ("model.layers.0.mlp.gate_proj", (128, 64))):
        _edit_tensors(adapter_dir, lambda t, m=module, s=shape: t.update({
            f"{PREFIX}{m}.lora_A.weight": torch.zeros(4, s[1]), f"{PREFIX}{m}.lora_B.weight": torch.zeros(s[0], 4)}))
        with pytest.raises(AdapterError, match="not an adaptable module") as info:
            LoraAdapter.open("a", adapter_dir, cfg)
        assert info.value.param == "path"
        shutil.copy2(adapters["deepseek_v2"] / WEIGHTS_FILE, adapter_dir / WEIGHTS_FILE)


def test_base_dir_shapes_are_checked(tiny_model_dirs, adapters):
    # a qwen3 config over the mixtral checkpoint: expert names differ, so the header check fails
    cfg = ModelConfig.from_pretrained(tiny_model_dirs["qwen3_moe"])
    with pytest.raises(AdapterError) as info:
        LoraAdapter.open("a", adapters["qwen3_moe"], cfg, base_dir=tiny_model_dirs["mixtral"])
    assert info.value.param == "base"


@pytest.mark.parametrize("arch", ARCHS)
def test_merged_model_is_base_plus_delta(arch, tiny_model_dirs, adapters, tmp_path):
    base_dir = tiny_model_dirs[arch]
    merged_dir = write_lora_merged_model(base_dir, adapters[arch], tmp_path / "merged")
    base, merged = base_tensors(base_dir), base_tensors(merged_dir)
    assert merged.keys() == base.keys()
    adapter = LoraAdapter.open("a", adapters[arch], ModelConfig.from_pretrained(base_dir))
    raw = load_file(str(adapters[arch] / WEIGHTS_FILE))
    for name, w in base.items():
        module = name.removesuffix(".weight")
        if module in adapter.modules:
            a, b = raw[f"{PREFIX}{module}.lora_A.weight"], raw[f"{PREFIX}{module}.lora_B.weight"]
            assert torch.allclose(merged[name], w + 2.0 * b @ a, atol=1e-6), name
            assert not torch.allclose(merged[name], w, atol=1e-3), name
        else:
            assert torch.equal(merged[name], w), name
    copied = {p.name for p in Path(base_dir).iterdir() if p.suffix != ".safetensors"}
    assert copied <= {p.name for p in merged_dir.iterdir()}
    with pytest.raises(AdapterError) as info:
        write_lora_merged_model(base_dir, adapters[arch], base_dir)
    assert info.value.param == "out"


def test_merged_qwen3_loads_in_transformers(tiny_model_dir, adapters, tmp_path):
    from transformers import AutoModelForCausalLM

    merged_dir = write_lora_merged_model(tiny_model_dir, adapters["qwen3_moe"], tmp_path / "merged")
    merged, info = AutoModelForCausalLM.from_pretrained(merged_dir, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    ids = torch.arange(1, 17).unsqueeze(0)
    with torch.no_grad():
        base_logits, merged_logits = base(ids).logits, merged(ids).logits
    assert not torch.allclose(base_logits, merged_logits, atol=1e-3)


def test_cli_writes_adapter_and_merged_model(tiny_model_dir, tmp_path, capsys):
    out, merged = tmp_path / "adapter", tmp_path / "merged"
    assert main(["make-lora-adapter", "--base", tiny_model_dir, "--out", str(out), "--rank", "2", "--alpha", "4",
                 "--targets", "o_proj,gate_proj", "--layers", "1", "--experts", "0,7", "--seed", "5", "--rslora",
                 "--merged-out", str(merged)]) == 0
    cfg = ModelConfig.from_pretrained(tiny_model_dir)
    adapter = LoraAdapter.open("cli", out, cfg, max_rank=2, base_dir=merged)
    assert adapter.config.use_rslora and adapter.config.lora_alpha == 4
    assert set(adapter.modules) == {"model.layers.1.self_attn.o_proj", "model.layers.1.mlp.experts.0.gate_proj",
                                    "model.layers.1.mlp.experts.7.gate_proj"}
    assert f"wrote {out}" in capsys.readouterr().out and (merged / "model.safetensors").is_file()


@pytest.mark.parametrize("extra, option", [
    (["--rank", "0"], "--rank"),
    (["--alpha", "-1"], "--alpha"),
    (["--targets", "q_proj,lm_head"], "--targets"),
    (["--targets", "w1"], "--targets"),
    (["--targets", ""], "--targets"),
    (["--layers", "0,9"], "--layers"),
    (["--layers", "a"], "--layers"),
    (["--experts", "8"], "--experts"),
    (["--experts", "1,x"], "--experts"),
])
def test_cli_bad_options_exit_2(extra, option, tiny_model_dir, tmp_path, capsys):
    assert main(["make-lora-adapter", "--base", tiny_model_dir, "--out", str(tmp_path / "a"), *extra]) == 2
    assert f"error: {option}:" in capsys.readouterr().err


def test_cli_bad_base_and_argparse_errors_exit_2(tiny_model_dir, tmp_path, capsys):
    assert main(["make-lora-adapter", "--base", str(tmp_path), "--out", str(tmp_path / "a")]) == 2
    assert "error: --base:" in capsys.readouterr().err
    with pytest.raises(SystemExit) as info:
        main(["make-lora-adapter", "--base", tiny_model_dir, "--out", str(tmp_path / "a"), "--rank", "two"])
    assert info.value.code == 2


def test_cli_help(capsys):
    with pytest.raises(SystemExit) as info:
        main(["make-lora-adapter", "--help"])
    assert info.value.code == 0
    text = capsys.readouterr().out
    assert "--targets" in text and "--merged-out" in text and "PEFT" in text and "w1" in text


def test_mla_kv_b_proj_is_rejected_with_the_reason(tiny_model_dirs, adapters, tmp_path, capsys):
    """kv_b_proj up-projects cached latents inside MLA: no LoRA on it (file, tool, HTTP 400)."""
    from fastapi import FastAPI
    from fastapi.testclient import TestClient

    from elasticmoe.entrypoints.openai.adapters_api import add_adapter_routes
    from elasticmoe.entrypoints.openai.errors import install_exception_handlers

    base = tiny_model_dirs["deepseek_v2"]
    cfg = ModelConfig.from_pretrained(base)
    kv_b = f"{PREFIX}model.layers.1.self_attn.kv_b_proj"
    as_target, untargeted = (Path(shutil.copytree(adapters["deepseek_v2"], tmp_path / d)) for d in ("t", "u"))
    for adapter_dir in (as_target, untargeted):
        _edit_tensors(adapter_dir, lambda t: t.update({f"{kv_b}.lora_A.weight": torch.zeros(4, 32),
                                                       f"{kv_b}.lora_B.weight": torch.zeros(128, 4)}))
    _edit_cfg(as_target, lambda c: c["target_modules"].append("kv_b_proj"))
    for adapter_dir in (as_target, untargeted):
        with pytest.raises(AdapterError, match="kv_b_proj cannot be adapted.*absorbed") as info:
            LoraAdapter.open("a", adapter_dir, cfg)
        assert info.value.param == "target_modules"
    with pytest.raises(AdapterError, match="kv_b_proj cannot be adapted"):
        make_lora_adapter(base, tmp_path / "kvb", target_modules=("q_proj", "kv_b_proj"))
    assert main(["make-lora-adapter", "--base", base, "--out", str(tmp_path / "kvb"), "--targets", "kv_b_proj"]) == 2
    assert "error: --targets: target_modules: kv_b_proj cannot be adapted" in capsys.readouterr().err

    class CheckingHost:  # the host checks the files before any engine sees them (as both servers' hosts do)
        async def load_lora(self, name, path, usage_probability=None):
            LoraAdapter.open(name, path, cfg)
            raise AssertionError("loaded")

    app = FastAPI()
    install_exception_handlers(app)
    add_adapter_routes(app, CheckingHost(), "base")  # type: ignore[arg-type]
    response = TestClient(app).post("/admin/adapters", json={"name": "kvb", "path": str(as_target), "type": "lora"})
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == "target_modules" and "kv_b_proj" in error["message"]
