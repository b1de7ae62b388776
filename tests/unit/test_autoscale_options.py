"""`elasticmoe serve` autoscaler options: flags, the `[autoscale]` table of `--config`, and the
RayService args (`coordinator.deployment.config_from_args`)."""

from __future__ import annotations

import pytest

from coordinator.deployment import config_from_args
from elasticmoe.cli import build_parser, main


def _args(*argv: str):
    return build_parser().parse_args(["serve", "--model", "m", *argv])


def test_flags_file_and_defaults_merge(tmp_path):
    from coordinator.cli_options import autoscale_config

    assert autoscale_config(_args()).enabled is False
    cfg = tmp_path / "ops.toml"
    cfg.write_text("[autoscale]\nenabled = true\nmin_dp = 2\nmax_dp = 4\nslo_ttft_s = 2\ncooldown_s = 60.5\n")
    merged = autoscale_config(_args("--config", str(cfg), "--autoscale-max-dp", "3"))
    assert (merged.enabled, merged.min_dp, merged.max_dp, merged.slo_ttft_s, merged.cooldown_s) == (
        True, 2, 3, 2, 60.5)  # the flag wins over the file
    assert autoscale_config(_args("--autoscale", "--autoscale-strategy", "cold_restart")).strategy == "cold_restart"


@pytest.mark.parametrize(
    "text, match",
    [
        ("[autoscale]\nmax_replicas = 3\n", r"\[autoscale\] max_replicas: unknown option"),
        ("[autoscaler]\nmin_dp = 1\n", "unknown table.*autoscaler"),
        ("[autoscale]\nmin_dp = 'two'\n", r"\[autoscale\] min_dp: input should be a valid integer"),
        ("[autoscale]\nenabled = 1\n", r"\[autoscale\] enabled: input should be a valid boolean"),
        ("[autoscale\n", "not valid TOML"),
        ("[autoscale]\nmin_dp = 0\n", "--autoscale-min-dp"),
    ],
)
def test_bad_config_files_name_the_problem(tmp_path, text, match):
    from coordinator.cli_options import autoscale_config

    cfg = tmp_path / "bad.toml"
    cfg.write_text(text)
    with pytest.raises(ValueError, match=match):
        autoscale_config(_args("--config", str(cfg)))


def test_serve_exits_2_naming_the_option(tmp_path, capsys, tiny_model_dir):
    assert main(["serve", "--model", tiny_model_dir, "--autoscale", "--autoscale-target-attainment", "1.5"]) == 2
    assert "--autoscale-target-attainment" in capsys.readouterr().err
    assert main(["serve", "--model", tiny_model_dir, "--config", str(tmp_path / "missing.toml")]) == 2
    assert "--config: cannot read" in capsys.readouterr().err
    assert main(["serve", "--single", "--model", tiny_model_dir, "--autoscale"]) == 2
    assert "needs the elastic server" in capsys.readouterr().err
    assert main(["serve", "--model", tiny_model_dir, "--api-key", "short"]) == 2
    assert "--api-key" in capsys.readouterr().err


def test_rayservice_args_build_the_config_with_keys_from_the_environment(tiny_model_dir):
    args = {"model_dir": tiny_model_dir, "num_devices": 2, "dp": 1, "max_body_bytes": 65536,
            "autoscale": {"enabled": True, "max_dp": 2}, "max_loras": 1,
            "lora_adapters": {"a": "/adapters/a"}}
    config = config_from_args(args, environ={"ELASTICMOE_API_KEY": "sk-0123456789", "ELASTICMOE_ADMIN_KEY": ""})
    assert config.autoscale.enabled and config.autoscale.max_dp == 2
    assert config.access.api_key == "sk-0123456789" and config.access.admin_key is None
    assert config.access.max_body_bytes == 65536 and config.lora_adapters == (("a", "/adapters/a"),)
    assert "sk-0123456789" not in repr(config)
    with pytest.raises(ValueError, match="unknown key.*api_key"):
        config_from_args({**args, "api_key": "sk-in-the-open"}, environ={})
