"""The CLI's light commands stay light: `drain-node` (a worker pod's preStop hook, on a node that
is still serving) and `drain` import neither torch nor Ray, and `import elasticmoe` loads its
public classes on first use only."""

from __future__ import annotations

import subprocess
import sys

import pytest

from elasticmoe.cli import _command_in, build_parser


def _modules_after(code: str) -> set[str]:
    # A fresh interpreter: this test process imported torch long ago.
    out = subprocess.run([sys.executable, "-c", code + "\nimport sys; print(' '.join(sys.modules))"],
                         capture_output=True, text=True, timeout=60, check=True)
    return set(out.stdout.split())


@pytest.mark.parametrize("argv", [["drain-node", "--node", "abc"], ["--log-level", "WARNING", "drain"]])
def test_the_drain_commands_parse_without_torch_or_ray(argv):
    loaded = _modules_after(f"from elasticmoe.cli import _command_in, build_parser\n"
                            f"argv = {argv!r}\nbuild_parser(_command_in(argv)).parse_args(argv)")
    assert not {"torch", "ray", "transformers"} & loaded


def test_the_package_loads_its_classes_on_first_use():
    loaded = _modules_after("import elasticmoe, elasticmoe.cli")
    assert "torch" not in loaded
    import elasticmoe

    assert elasticmoe.SamplingParams.__name__ == "SamplingParams" and elasticmoe.LLM.__module__ == "elasticmoe.llm"
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        elasticmoe.nope  # noqa: B018


def test_the_command_is_the_first_word_naming_one():
    assert _command_in(["--log-level", "serve", "drain", "--url", "x"]) == "drain"  # a level named like a command
    assert _command_in(["serve", "--model", "drain"]) == "serve"
    assert _command_in(["--help"]) is None


def test_without_a_command_the_parser_knows_every_command(capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--help"])
    listed = capsys.readouterr().out
    assert all(name in listed for name in ("serve", "drain-node", "make-model", "reap-shm"))
