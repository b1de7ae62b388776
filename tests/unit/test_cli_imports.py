"""The CLI's light commands stay light: `drain-node` (a worker pod's preStop hook, on a node that
is still serving) and `drain` import neither torch nor Ray, and `import elasticmoe` loads its
public classes on first use only. `serve` validates its options (the elastic server's config)
without torch or Ray; the elastic server's ingress, the rank's actor module and what deploys the
server import no torch; and `hmm.memory` loads its names on first use."""

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


def test_serve_validates_its_options_without_torch_or_ray(tiny_model_dir):
    # A bad flag exits 2 before Ray starts; that check loads neither (~0.6 s, was ~2.5 s with torch).
    loaded = _modules_after(f"from coordinator.cli_options import elastic_config\n"
                            f"from elasticmoe.cli import build_parser\n"
                            f"argv = ['serve', '--model', {tiny_model_dir!r}, '--devices', '2', '--dp', '2']\n"
                            f"assert elastic_config(build_parser('serve').parse_args(argv)).dp == 2\n"
                            f"import elasticmoe.entrypoints.openai.routes, hmm.memory.segments")
    assert not {"torch", "ray"} & loaded and "coordinator.config" in loaded


def test_the_ingress_the_rank_actor_and_the_deploying_process_import_without_torch():
    # The ingress replica imports the first; Ray imports the second in every process that gets a
    # rank's actor handle (the ingress holds one per rank); `elasticmoe serve` imports the third
    # to deploy the application. The ingress is checked at run time over HTTP in
    # tests/e2e/test_elastic_server_api.py.
    loaded = _modules_after("import coordinator.ingress, imm.rank, coordinator.launch")
    assert "torch" not in loaded and {"imm.rank", "coordinator.controller"} <= loaded


def test_hmm_memory_loads_each_name_from_its_module_on_first_use():
    import hmm.memory
    from hmm.memory import segments, shm, vpage

    assert all(getattr(hmm.memory, name) is not None for name in hmm.memory.__all__)
    assert hmm.memory.list_segments is segments.list_segments and hmm.memory.ShmBackend is shm.ShmBackend
    assert hmm.memory.VirtualTensor is vpage.VirtualTensor
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        hmm.memory.nope  # noqa: B018


def test_the_command_is_the_first_word_naming_one():
    assert _command_in(["--log-level", "serve", "drain", "--url", "x"]) == "drain"  # a level named like a command
    assert _command_in(["serve", "--model", "drain"]) == "serve"
    assert _command_in(["--help"]) is None


def test_without_a_command_the_parser_knows_every_command(capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--help"])
    listed = capsys.readouterr().out
    assert all(name in listed for name in ("serve", "drain-node", "make-model", "reap-shm"))
