"""Settings declared once (`elasticmoe.utils.settings`): every field of `CoordinatorConfig` is a
flag, a `[serve]` key of `--config` and a RayService arg, with one meaning in all three."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from coordinator.autoscaler import AutoscaleConfig
from coordinator.cli_options import elastic_config
from coordinator.config import CoordinatorConfig
from coordinator.deployment import config_from_args
from elasticmoe.cli import build_parser, main
from elasticmoe.entrypoints.serve_settings import ServeSettings
from elasticmoe.utils.settings import GIB, flag_name, from_sources, secret_fields

CHART_SCHEMA = Path(__file__).resolve().parents[2] / "helm" / "elasticmoe" / "values.schema.json"
# Non-default values of every kind of field, as a file or Serve args would give them.
SAMPLE = {"dtype": "bfloat16", "served_model_name": "m", "max_model_len": 64, "kv_bytes_per_device": 8 << 20,
          "max_num_seqs": 4, "num_threads": 2, "max_esft_adapters": 2, "max_loras": 1, "max_lora_rank": 8,
          "lora_adapters": {"a": "/adapters/a"}, "lora_target_modules": ("q_proj", "v_proj"), "max_body_bytes": 65536, "shutdown_timeout_s": 5.0,
          "num_devices": 3, "dp": 2, "device_memory_bytes": 64 << 20, "max_queued": 9, "standby_pool": False,
          "standby_delay_s": 1.5, "shm_prefix": "emoeunit"}


def _serve_args(*argv: str):
    return build_parser().parse_args(["serve", *argv])


def _help() -> str:
    return build_parser()._subparsers._group_actions[0].choices["serve"].format_help()  # type: ignore[union-attr]


def _as_flags(values: dict) -> list[str]:
    argv = []
    for name, value in values.items():
        flag = flag_name(CoordinatorConfig, name)
        if isinstance(value, bool):
            argv.append(flag if value else flag.replace("--", "--no-", 1))
        elif isinstance(value, dict):
            for key, path in value.items():
                argv += [flag, f"{key}={path}"]
        elif isinstance(value, tuple):
            argv += [flag, ",".join(value)]
        elif name in ("kv_bytes_per_device", "device_memory_bytes"):
            argv += [flag, f"{value / GIB!r}"]
        else:
            argv += [flag, str(value)]
    return argv


def test_every_setting_has_a_flag_with_help():
    text = _help()
    for model, prefix in ((CoordinatorConfig, ""), (AutoscaleConfig, "autoscale-")):
        for name, field in model.model_fields.items():
            if name == "autoscale":
                continue
            assert flag_name(model, name, prefix) in text, name
            assert field.description, f"{name} has no description"


def test_flags_file_and_serve_args_mean_the_same(tiny_model_dir, tmp_path):
    assert set(SAMPLE) | {"model_dir", "autoscale"} <= set(CoordinatorConfig.model_fields)
    from_flags = elastic_config(_serve_args("--model", tiny_model_dir, "--config", str(_toml(tmp_path, {})),
                                            *_as_flags(SAMPLE)))
    from_file = elastic_config(_serve_args("--config", str(_toml(tmp_path, {"model_dir": tiny_model_dir, **SAMPLE}))))
    from_args = config_from_args({"model_dir": tiny_model_dir, **SAMPLE}, environ={})
    assert from_flags == from_file == from_args
    assert from_args.kv_bytes_per_device == 8 << 20 and from_args.lora_adapters == (("a", "/adapters/a"),)
    assert from_args.standby_pool is False and from_args.engine_options().max_cpu_loras is None  # = the slots


def _toml(tmp_path: Path, serve: dict, autoscale: dict | None = None) -> Path:
    def value(v):
        if isinstance(v, dict):
            return "{" + ", ".join(f"{k} = {json.dumps(x)}" for k, x in v.items()) + "}"
        return json.dumps(v)

    lines = ["[serve]", *(f"{k} = {value(v)}" for k, v in serve.items())]
    if autoscale:
        lines += ["[autoscale]", *(f"{k} = {value(v)}" for k, v in autoscale.items())]
    path = tmp_path / f"serve{len(list(tmp_path.iterdir()))}.toml"
    path.write_text("\n".join(lines) + "\n")
    return path


def test_a_flag_wins_over_the_file_and_the_file_over_the_default(tiny_model_dir, tmp_path):
    cfg = _toml(tmp_path, {"model_dir": tiny_model_dir, "max_queued": 7, "num_devices": 2},
                {"enabled": True, "min_dp": 2})
    config = elastic_config(_serve_args("--config", str(cfg), "--max-queued", "11"))
    assert (config.max_queued, config.num_devices, config.dp, config.autoscale.enabled, config.autoscale.min_dp) == (
        11, 2, 1, True, 2)
    assert config.kv_bytes_per_device == min(GIB // 4, config.device_memory_bytes // 4)  # the elastic default
    assert config.engine_options().engine_config(tiny_model_dir).enable_prefix_caching  # on by default
    off = elastic_config(_serve_args("--config", str(cfg), "--no-enable-prefix-caching"))
    assert not off.engine_options().engine_config(tiny_model_dir).enable_prefix_caching


@pytest.mark.parametrize(
    "serve, message",
    [
        ({"max_queued": "many"}, r"\[serve\] max_queued: input should be a valid integer, got 'many'"),
        ({"devices": 2}, r"\[serve\] devices: unknown option"),
        ({"dp": 3, "num_devices": 2}, "--dp: 3 ranks need 3 devices"),
        ({"api_key": "sk-0123456789abcdef"}, r"\[serve\] api_key: secrets go in a flag or \$ELASTICMOE_API_KEY"),
        ({"lora_adapters": ["nope"]}, "--lora-adapter: want NAME=DIR, got 'nope'"),
        ({"max_loras": 1, "lora_target_modules": ["q_proj", "qv_proj"]},
         "--lora-target-modules: want distinct names among q_proj, .* got q_proj, qv_proj"),
        ({"lora_target_modules": ["q_proj"]}, "--lora-target-modules: the modules of LoRA slots; give --max-loras"),
        ({"max_loras": 1, "lora_target_modules": ["q_proj", "q_a_proj"]},
         r"--lora-target-modules: this model has no q_a_proj \(its LoRA targets: q_proj, k_proj, v_proj, o_proj, "),
    ],
)
def test_bad_file_values_name_the_file_and_key(tiny_model_dir, tmp_path, serve, message):
    with pytest.raises(ValueError, match=message) as caught:
        elastic_config(_serve_args("--config", str(_toml(tmp_path, {"model_dir": tiny_model_dir, **serve}))))
    assert "sk-0123456789abcdef" not in str(caught.value)


def test_keys_come_from_flags_or_the_environment_never_echoed(tiny_model_dir, monkeypatch, capsys):
    monkeypatch.setenv("ELASTICMOE_API_KEY", "sk-from-the-environment")
    config = elastic_config(_serve_args("--model", tiny_model_dir))
    assert config.access.api_key == "sk-from-the-environment"
    assert "sk-from-the-environment" not in repr(config) and "sk-from-the-environment" not in _help()
    config = elastic_config(_serve_args("--model", tiny_model_dir, "--api-key", "sk-from-the-flag"))
    assert config.access.api_key == "sk-from-the-flag"
    assert main(["serve", "--model", tiny_model_dir, "--admin-key", "sk-short"[:5]]) == 2
    err = capsys.readouterr().err
    assert "--admin-key" in err and "sk-sh" not in err
    assert secret_fields(CoordinatorConfig) == {"api_key", "admin_key"}
    with pytest.raises(ValueError, match="keys come from"):
        config_from_args({"model_dir": tiny_model_dir, "api_key": "sk-0123456789"}, environ={})


def test_single_server_takes_the_shared_settings_and_refuses_elastic_ones(tiny_model_dir, tmp_path, capsys):
    cfg = _toml(tmp_path, {"model_dir": tiny_model_dir, "max_num_seqs": 3, "kv_bytes_per_device": 1 << 20})
    settings = from_sources(ServeSettings, _serve_args("--single", "--config", str(cfg)), str(cfg), "serve",
                            tables={"serve", "autoscale"})
    options = settings.engine_options()
    assert (options.max_num_seqs, options.kv_cache_bytes, options.max_cpu_loras) == (3, 1 << 20, None)
    assert main(["serve", "--single", "--model", tiny_model_dir, "--devices", "2"]) == 2
    assert "--devices: needs the elastic server" in capsys.readouterr().err
    elastic = _toml(tmp_path, {"model_dir": tiny_model_dir, "num_devices": 2})
    assert main(["serve", "--single", "--config", str(elastic)]) == 2
    assert "num_devices: unknown option" in capsys.readouterr().err


def test_the_chart_offers_every_setting_the_serve_args_take():
    """The Helm chart's values schema cannot drift from the settings: every RayService arg has a
    values key and every values key is an arg (model_dir comes from model.path, num_devices from the
    worker pods, keys from a Secret)."""
    schema = json.loads(CHART_SCHEMA.read_text())["properties"]
    not_in_chart = {"model_dir", "num_devices", "autoscale", "max_cpu_loras"} | secret_fields(CoordinatorConfig)
    assert set(schema["coordinator"]["properties"]) == set(CoordinatorConfig.model_fields) - not_in_chart
    assert set(schema["autoscale"]["properties"]) == set(AutoscaleConfig.model_fields)


def test_a_profile_fills_the_memory_split_unless_given(tiny_model_dir, tmp_path):
    from elasticmoe.adapter_policy.profile import KindProfile, MemorySplit, Profile

    split = MemorySplit(budget_bytes=1 << 30, kv_cache_bytes=256 << 20, num_lora_slots=6, lora_slot_bytes=1 << 20,
                        max_num_seqs=24, esft_bytes=3 << 20, num_esft_slots=3, lora_target_modules=("q_proj", "v_proj"))
    profile = Profile("m", "cpu", {"base": KindProfile(16, 0.01, 0.1), "lora": KindProfile(16, 0.012, 0.1, 0.05)},
                      kv_bytes_per_token=4096, tokens_per_request=256, usage_probability={"law": 0.6},
                      memory_split=split)
    path = tmp_path / "profile.json"
    path.write_text(json.dumps(profile.to_json()))
    settings = ServeSettings(model_dir=tiny_model_dir, profile=str(path), adapter_eviction="lru")
    # In the settings themselves, so every reader sees the split, not only the engines.
    assert (settings.kv_bytes_per_device, settings.max_num_seqs, settings.max_loras, settings.max_esft_adapters) == (
        256 << 20, 24, 6, 3)
    options = settings.engine_options()
    assert (options.kv_cache_bytes, options.max_num_seqs, options.max_loras, options.max_esft_adapters) == (
        256 << 20, 24, 6, 3)
    assert options.adapter_eviction == "lru" and options.adapter_profile == str(path)
    assert options.lora_target_modules == ("q_proj", "v_proj")  # the slots the split's slot bytes are of
    given = ServeSettings(model_dir=tiny_model_dir, profile=str(path), max_num_seqs=8, max_esft_adapters=1,
                          lora_target_modules="q_proj")
    assert (given.max_num_seqs, given.max_esft_adapters, given.max_loras) == (8, 1, 6)  # a given value wins
    assert given.lora_target_modules == ("q_proj",)
    # The elastic server: the split's KV is each device's HMM pool, its slots what /admin/status counts.
    elastic = CoordinatorConfig(model_dir=tiny_model_dir, profile=str(path), device_memory_bytes=1 << 31)
    assert (elastic.hmm_kv_bytes, elastic.max_loras, elastic.max_esft_adapters) == (256 << 20, 6, 3)
    assert CoordinatorConfig(model_dir=tiny_model_dir, device_memory_bytes=1 << 31).hmm_kv_bytes == GIB // 4
    with pytest.raises(ValueError, match="--profile: .* is not a file"):
        ServeSettings(model_dir=tiny_model_dir, profile=str(tmp_path / "nope.json"))
    (tmp_path / "bad.json").write_text("{}")
    with pytest.raises(ValueError, match="--profile: .*bad.json: .*version"):
        ServeSettings(model_dir=tiny_model_dir, profile=str(tmp_path / "bad.json"))
    with pytest.raises(ValueError, match="adapter_eviction"):
        ServeSettings(model_dir=tiny_model_dir, adapter_eviction="random")


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--backend", "vllm", "--expert-parallel"], "--expert-parallel: vLLM's CPU build cannot run expert parallelism"),
        (["--backend", "vllm", "--esft-adapter", "a=/adapters/a"], "--esft-adapter: ESFT adapters need --backend native"),
        (["--backend", "vllm", "--max-loras", "1"], "--max-loras: LoRA adapters need --backend native"),
        (["--no-expert-parallel"], "--no-expert-parallel: the native backend always spreads its experts"),
        (["--expert-tier", "disk"], "--expert-tier disk: the disk tier is where an expert cache reads from"),
        (["--expert-page-cache", "drop"], "--expert-page-cache drop: only experts an expert cache reads from the "
         "checkpoint"),
        (["--expert-cache-fraction", "0.5", "--expert-page-cache", "drop"],
         "--expert-page-cache drop: the elastic server's caches read the host tier"),
        (["--backend", "vllm"], r"--backend vllm: vLLM's CPU attention supports head_dim .* the model has 16"),
    ],
)
def test_unsupported_backend_combinations_exit_2_naming_the_flag(tiny_model_dir, monkeypatch, capsys, argv, message):
    monkeypatch.setattr("imm.vllm_support.installed_version", lambda: "0.32.0")  # as in the vllm venv
    assert main(["serve", "--model", tiny_model_dir, *argv]) == 2
    err = capsys.readouterr().err
    assert re.search(message, err), err


def test_the_vllm_backend_serves_replicas_of_a_model_it_can_run(tiny_model_dir, tmp_path, monkeypatch):
    from elasticmoe.tools.make_model import make_model

    model = str(make_model("qwen3_moe", "tiny-vllm", seed=0, out=str(tmp_path / "m")))
    monkeypatch.setattr("imm.vllm_support.installed_version", lambda: None)
    with pytest.raises(ValueError, match=r"--backend vllm: vLLM is not installed .*pip install -e '\.\[vllm\]'"):
        elastic_config(_serve_args("--model", model, "--backend", "vllm"))
    monkeypatch.setattr("imm.vllm_support.installed_version", lambda: "0.32.0")
    config = elastic_config(_serve_args("--model", model, "--backend", "vllm", "--dp", "2", "--devices", "2"))
    assert not config.is_expert_parallel and config.esft_slots == (0, 0)
    assert config.engine_options().max_esft_adapters == 0
    native = elastic_config(_serve_args("--model", tiny_model_dir))
    assert native.backend == "native" and native.is_expert_parallel and native.esft_slots == (4, 16)
    assert native.expert_tier == "host" and native.engine_options().expert_tier == "host"
    on_disk = elastic_config(_serve_args("--model", tiny_model_dir, "--expert-tier", "disk",
                                         "--expert-cache-fraction", "0.5", "--expert-page-cache", "drop"))
    assert on_disk.esft_slots == (4, 16) and on_disk.engine_options().expert_tier == "disk"
    assert on_disk.engine_options().expert_page_cache == "drop" and native.engine_options().expert_page_cache == "keep"


def test_a_description_may_say_percent():
    """argparse formats help with %: a description's own "%" must show as itself, not break --help."""
    import argparse

    from pydantic import BaseModel, Field

    from elasticmoe.utils.settings import add_flags

    class Options(BaseModel):
        share: float = Field(0.5, description="up to 50% of the cores")

    parser = argparse.ArgumentParser(prog="x")
    add_flags(parser, Options)
    assert "up to 50% of the cores (default 0.5)" in " ".join(parser.format_help().split())
