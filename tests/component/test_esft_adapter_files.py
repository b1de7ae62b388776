"""ESFT adapter files on tiny real-architecture checkpoints: make, open, validate,
merge (the merged model is the oracle for adapter serving), and the CLI."""

from __future__ import annotations

import json
import pickle
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from elasticmoe.adapters.esft import EsftAdapter, EsftConfig, expert_tensors
from elasticmoe.cli import main
from elasticmoe.config import ModelConfig
from elasticmoe.errors import AdapterError
from elasticmoe.models.registry import model_family
from elasticmoe.models.weights import SafetensorsWeightProvider
from elasticmoe.tools.make_esft_adapter import ADAPTER_FILE, make_esft_adapter, write_merged_model

ARCHS = ("qwen3_moe", "mixtral", "deepseek_v2")
LAW = Path("/work/shared/data/esft_expert_configs/law.json")


@pytest.fixture(scope="module")
def adapters(tiny_model_dirs, tmp_path_factory) -> dict[str, Path]:
    """arch -> adapter with 2 random experts per MoE layer."""
    root = tmp_path_factory.mktemp("adapters")
    return {arch: make_esft_adapter(tiny_model_dirs[arch], root / arch, experts_per_layer=2, seed=3)
            for arch in ARCHS}


def base_tensors(model_dir: str) -> dict[str, torch.Tensor]:
    return load_file(str(Path(model_dir) / "model.safetensors"))


@pytest.mark.parametrize("arch", ARCHS)
def test_adapter_rows_match_file_and_differ_from_base(arch, tiny_model_dirs, adapters):
    cfg = ModelConfig.from_pretrained(tiny_model_dirs[arch])
    adapter = EsftAdapter.open("a", adapters[arch], cfg)
    assert adapter.config.experts.keys() == set(cfg.moe_layer_ids)
    assert all(len(ids) == 2 for ids in adapter.config.experts.values())
    stored = load_file(str(adapters[arch] / ADAPTER_FILE))
    base = base_tensors(tiny_model_dirs[arch])
    layout = expert_tensors(cfg)
    for layer, ids in adapter.config.experts.items():
        for e in ids:
            w13, w2 = adapter.expert_weights(layer, e)
            names = layout[layer, e]
            assert w13.shape == (2 * cfg.moe_intermediate_size, cfg.hidden_size)
            assert w2.shape == (cfg.hidden_size, cfg.moe_intermediate_size)
            assert torch.equal(w13, torch.cat([stored[n] for n in names.w13]))
            assert torch.equal(w2, stored[names.w2[0]])
            base_w13 = torch.cat([base[n] for n in names.w13])
            assert not torch.allclose(w13, base_w13, atol=1e-3)
            assert torch.allclose(w13, base_w13, atol=0.5 * base_w13.abs().max().item())  # noise, not new weights
    assert set(stored) == {n for (layer, e), t in layout.items() if e in adapter.config.experts.get(layer, ())
                           for n in t.shapes()}
    assert adapter.nbytes() == sum(t.numel() * t.element_size() for t in stored.values())
    assert adapter.nbytes(torch.bfloat16) == adapter.nbytes() // 2
    layer, ids = next(iter(adapter.config.experts.items()))
    assert adapter.expert_weights(layer, ids[0], torch.bfloat16)[0].dtype == torch.bfloat16
    copy = pickle.loads(pickle.dumps(adapter))
    assert torch.equal(copy.expert_weights(layer, ids[0])[1], adapter.expert_weights(layer, ids[0])[1])
    untuned = next(e for e in range(cfg.num_experts) if e not in ids)
    with pytest.raises(KeyError):
        adapter.expert_weights(layer, untuned)


def test_same_seed_same_adapter(tiny_model_dir, adapters, tmp_path):
    again = make_esft_adapter(tiny_model_dir, tmp_path / "again", experts_per_layer=2, seed=3)
    assert (again / "expert_cfg.json").read_text() == (adapters["qwen3_moe"] / "expert_cfg.json").read_text()
    first, second = load_file(str(adapters["qwen3_moe"] / ADAPTER_FILE)), load_file(str(again / ADAPTER_FILE))
    assert first.keys() == second.keys() and all(torch.equal(first[k], second[k]) for k in first)


@pytest.mark.parametrize("arch", ["qwen3_moe", "deepseek_v2"])
def test_real_config_needs_fit(arch, tiny_model_dirs, tmp_path):
    model_dir = tiny_model_dirs[arch]
    cfg = ModelConfig.from_pretrained(model_dir)
    law = EsftConfig.from_file(LAW)
    with pytest.raises(AdapterError) as info:
        make_esft_adapter(model_dir, tmp_path / "nofit", config=law)
    assert info.value.param == "experts"
    out = make_esft_adapter(model_dir, tmp_path / "fit", config=law, fit=True)
    adapter = EsftAdapter.open("law", out, cfg)
    assert adapter.config == law.fitted_to(cfg)
    assert set(adapter.config.experts) == {layer for layer in law.experts if cfg.is_moe_layer(layer)}
    # law.json layer 1 lists [12, 40, 7, 13, 37, 16, 1, 17, 9]; folded modulo 8 and deduplicated, in order
    assert adapter.config.experts[1] == (4, 0, 7, 5, 1)


def rewrite_tensors(adapter_dir: Path, edit) -> None:
    path = adapter_dir / ADAPTER_FILE
    tensors = load_file(str(path))
    edit(tensors)
    save_file(tensors, str(path))


def rewrite_cfg(adapter_dir: Path, edit) -> None:
    path = adapter_dir / "expert_cfg.json"
    obj = json.loads(path.read_text())
    edit(obj)
    path.write_text(json.dumps(obj))


def _drop_one(t: dict) -> None:
    t.pop(sorted(t)[0])


def _reshape_one(t: dict) -> None:
    name = sorted(t)[0]
    t[name] = t[name][:-1].contiguous()


TAMPERS = {
    "missing tensor": ("path", "missing", lambda d: rewrite_tensors(d, _drop_one)),
    "wrong shape": ("path", "shape", lambda d: rewrite_tensors(d, _reshape_one)),
    "extra tensor": ("path", "unexpected", lambda d: rewrite_tensors(
        d, lambda t: t.update({"model.layers.0.mlp.gate.weight": torch.zeros(8, 64)}))),
    "extra file": ("path", "unexpected", lambda d: save_file({"lm_head.weight": torch.zeros(2, 2)},
                                                             str(d / "more.safetensors"))),
    "layer out of range": ("experts", "out of range", lambda d: rewrite_cfg(
        d, lambda c: c["experts"].update({"2": [0]}))),
    "expert out of range": ("experts", "outside", lambda d: rewrite_cfg(
        d, lambda c: c["experts"].update({"1": [8]}))),
    "shared experts": ("path", "not supported", lambda d: rewrite_cfg(d, lambda c: c.update(shared_experts=True))),
    "non-expert modules": ("path", "not supported", lambda d: rewrite_cfg(
        d, lambda c: c.update(non_expert_modules=True))),
    "bad id type": ("experts", "integer", lambda d: rewrite_cfg(d, lambda c: c["experts"].update({"1": ["x"]}))),
    "no expert_cfg": ("path", "expert_cfg.json", lambda d: (d / "expert_cfg.json").unlink()),
    "no weights": ("path", "safetensors", lambda d: (d / ADAPTER_FILE).unlink()),
}


@pytest.mark.parametrize("case", sorted(TAMPERS))
def test_tampered_adapter_is_rejected(case, tiny_model_dir, adapters, tmp_path):
    param, words, tamper = TAMPERS[case]
    adapter_dir = Path(shutil.copytree(adapters["qwen3_moe"], tmp_path / "adapter"))
    cfg = ModelConfig.from_pretrained(tiny_model_dir)
    EsftAdapter.open("ok", adapter_dir, cfg)
    tamper(adapter_dir)
    with pytest.raises(AdapterError, match=words) as info:
        EsftAdapter.open("bad", adapter_dir, cfg)
    assert info.value.param == param


def test_dense_layer_is_rejected(tiny_model_dirs, adapters, tmp_path):
    adapter_dir = Path(shutil.copytree(adapters["deepseek_v2"], tmp_path / "adapter"))
    rewrite_cfg(adapter_dir, lambda c: c["experts"].update({"0": [1]}))  # first_k_dense_replace=1
    with pytest.raises(AdapterError, match="dense") as info:
        EsftAdapter.open("bad", adapter_dir, ModelConfig.from_pretrained(tiny_model_dirs["deepseek_v2"]))
    assert info.value.param == "experts"


@pytest.mark.parametrize("arch", ARCHS)
def test_merged_model_swaps_exactly_the_tuned_experts(arch, tiny_model_dirs, adapters, tmp_path):
    base_dir = tiny_model_dirs[arch]
    merged_dir = write_merged_model(base_dir, adapters[arch], tmp_path / "merged")
    base, merged = base_tensors(base_dir), base_tensors(str(merged_dir))
    tuned = load_file(str(adapters[arch] / ADAPTER_FILE))
    assert merged.keys() == base.keys()
    for name, t in merged.items():
        assert torch.equal(t, tuned[name] if name in tuned else base[name]), name
    assert {p.name for p in Path(base_dir).iterdir()} <= {p.name for p in merged_dir.iterdir()}
    assert (merged_dir / "config.json").read_text() == (Path(base_dir) / "config.json").read_text()
    with safe_open(str(merged_dir / "model.safetensors"), framework="pt") as f:
        assert f.metadata() == {"format": "pt"}

    # The engine's loader, reading the merged checkpoint, assembles the adapter's rows.
    cfg = ModelConfig.from_pretrained(base_dir)
    adapter = EsftAdapter.open("a", adapters[arch], cfg)
    specs = {s.name: s for s in model_family(arch).param_specs(cfg, tuple(range(cfg.num_experts)))}
    provider = SafetensorsWeightProvider(merged_dir)
    for layer, ids in adapter.config.experts.items():
        w13 = provider.get(specs[f"layers.{layer}.moe.w13"], torch.float32)
        w2 = provider.get(specs[f"layers.{layer}.moe.w2"], torch.float32)
        for e in ids:
            a13, a2 = adapter.expert_weights(layer, e, torch.float32)
            assert torch.equal(w13[e], a13) and torch.equal(w2[e], a2)


def test_merged_qwen3_loads_in_transformers(tiny_model_dir, adapters, tmp_path):
    from transformers import AutoModelForCausalLM

    merged_dir = write_merged_model(tiny_model_dir, adapters["qwen3_moe"], tmp_path / "merged")
    merged, info = AutoModelForCausalLM.from_pretrained(merged_dir, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    ids = torch.arange(1, 17).unsqueeze(0)
    with torch.no_grad():
        base_logits, merged_logits = base(ids).logits, merged(ids).logits
    assert not torch.allclose(base_logits, merged_logits, atol=1e-4)


def test_cli_writes_adapter_and_merged_model(tiny_model_dir, tmp_path, capsys):
    out, merged = tmp_path / "adapter", tmp_path / "merged"
    assert main(["make-esft-adapter", "--base", tiny_model_dir, "--out", str(out), "--experts-per-layer", "3",
                 "--seed", "5", "--noise", "0.1", "--merged-out", str(merged)]) == 0
    cfg = ModelConfig.from_pretrained(tiny_model_dir)
    adapter = EsftAdapter.open("cli", out, cfg)
    assert adapter.config.max_experts_per_layer == 3
    assert (merged / "model.safetensors").is_file() and (merged / "tokenizer.json").is_file()
    assert main(["make-esft-adapter", "--base", tiny_model_dir, "--out", str(tmp_path / "law"),
                 "--config", str(LAW), "--fit"]) == 0
    assert EsftAdapter.open("law", tmp_path / "law", cfg).config == EsftConfig.from_file(LAW).fitted_to(cfg)


@pytest.mark.parametrize("extra, option", [
    (["--experts-per-layer", "99"], "--experts-per-layer"),
    (["--experts-per-layer", "0"], "--experts-per-layer"),
    (["--experts-per-layer", "2", "--noise", "-1"], "--noise"),
    (["--experts-per-layer", "2", "--fit"], "--fit"),
    (["--config", str(LAW)], "--config"),
    (["--config", "/nonexistent/cfg.json"], "--config"),
])
def test_cli_bad_options_exit_2(extra, option, tiny_model_dir, tmp_path, capsys):
    assert main(["make-esft-adapter", "--base", tiny_model_dir, "--out", str(tmp_path / "a"), *extra]) == 2
    assert f"error: {option}:" in capsys.readouterr().err


@pytest.mark.parametrize("extra", [[], ["--experts-per-layer", "2", "--config", str(LAW)], ["--experts-per-layer", "x"]])
def test_cli_argparse_errors_exit_2(extra, tiny_model_dir, tmp_path):
    with pytest.raises(SystemExit) as info:
        main(["make-esft-adapter", "--base", tiny_model_dir, "--out", str(tmp_path / "a"), *extra])
    assert info.value.code == 2


def test_cli_bad_base_exits_2(tmp_path, capsys):
    assert main(["make-esft-adapter", "--base", str(tmp_path), "--out", str(tmp_path / "a"),
                 "--experts-per-layer", "2"]) == 2
    assert "error: --base:" in capsys.readouterr().err


def test_cli_help(capsys):
    with pytest.raises(SystemExit) as info:
        main(["make-esft-adapter", "--help"])
    assert info.value.code == 0
    text = capsys.readouterr().out
    assert "--experts-per-layer" in text and "--merged-out" in text and "expert_cfg.json" in text


def test_tensors_named_relative_to_the_inner_model_are_read_too(tiny_model_dirs, adapters, tmp_path):
    """The ESFT repository's loader names tensors relative to `model.model` ("layers..."): accepted."""
    cfg = ModelConfig.from_pretrained(tiny_model_dirs["qwen3_moe"])
    full = EsftAdapter.open("a", adapters["qwen3_moe"], cfg)
    relative = tmp_path / "relative"
    relative.mkdir()
    shutil.copy(adapters["qwen3_moe"] / "expert_cfg.json", relative / "expert_cfg.json")
    stored = load_file(str(adapters["qwen3_moe"] / ADAPTER_FILE))
    assert all(n.startswith("model.") for n in stored)
    save_file({n.removeprefix("model."): t for n, t in stored.items()}, str(relative / ADAPTER_FILE))
    short = EsftAdapter.open("a", relative, cfg)
    for layer, ids in full.config.experts.items():
        for e in ids:
            assert all(torch.equal(x, y) for x, y in zip(short.expert_weights(layer, e), full.expert_weights(layer, e),
                                                           strict=True))


def test_the_kind_is_read_from_the_files(tiny_model_dirs, adapters, tmp_path):
    from elasticmoe.entrypoints.openai.adapters_api import adapter_kind
    from elasticmoe.tools.make_lora_adapter import make_lora_adapter

    assert adapter_kind(str(adapters["qwen3_moe"])) == "esft"
    assert adapter_kind(str(make_lora_adapter(tiny_model_dirs["qwen3_moe"], str(tmp_path / "lora")))) == "lora"
    for nothing in (tmp_path, tmp_path / "missing"):  # the same answer: no hint which paths exist
        with pytest.raises(AdapterError, match="no adapter here") as info:
            adapter_kind(str(nothing))
        assert info.value.param == "path"
