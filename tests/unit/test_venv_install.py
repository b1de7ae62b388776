"""scripts/venv_install.py: pip's configuration handed to uv (index, find-links, constraints, cert)."""

from __future__ import annotations

import importlib.util
import subprocess
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "venv_install.py"


@pytest.fixture(scope="module")
def venv_install():
    spec = importlib.util.spec_from_file_location("venv_install", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


PIP_CONFIG_LIST = """\
:env:.find-links='/opt/wheels'
:env:.default-timeout='180'
global.cert='/etc/ssl/certs/ca.crt'
global.constraint='/etc/pip/constraints.txt'
global.extra-index-url='file:///opt/a/simple file:///opt/b/simple'
global.find-links='/somewhere/else'
install.index-url='https://mirror.example/simple'
freeze.all='true'
"""


def test_pip_settings_take_the_variables_over_the_files(venv_install, monkeypatch):
    def fake_run(cmd, **kwargs):
        assert cmd[1:] == ["-m", "pip", "config", "list"]
        return subprocess.CompletedProcess(cmd, 0, stdout=PIP_CONFIG_LIST, stderr="")

    monkeypatch.setattr(venv_install.subprocess, "run", fake_run)
    settings = venv_install.pip_settings("python")
    assert settings == {
        "find-links": "/opt/wheels",  # PIP_FIND_LINKS wins over the file's
        "default-timeout": "180",
        "cert": "/etc/ssl/certs/ca.crt",
        "constraint": "/etc/pip/constraints.txt",
        "extra-index-url": "file:///opt/a/simple file:///opt/b/simple",
        "index-url": "https://mirror.example/simple",
    }  # `freeze.*` is not an install option


def test_uv_gets_every_index_and_pips_index_rule(venv_install):
    flags, env = venv_install.uv_arguments({
        "extra-index-url": "file:///opt/a/simple file:///opt/b/simple", "find-links": "/opt/wheels",
        "constraint": "/etc/pip/constraints.txt", "cert": "/etc/ssl/certs/ca.crt", "default-timeout": "180",
    })
    assert flags == ["--index-strategy", "unsafe-best-match",
                     "--extra-index-url", "file:///opt/a/simple", "--extra-index-url", "file:///opt/b/simple",
                     "--find-links", "/opt/wheels", "--constraint", "/etc/pip/constraints.txt"]
    assert env == {"SSL_CERT_FILE": "/etc/ssl/certs/ca.crt", "UV_HTTP_TIMEOUT": "180"}
    assert venv_install.uv_arguments({}) == (["--index-strategy", "unsafe-best-match"], {})


@pytest.mark.parametrize("uv_installs", [True, False], ids=["uv", "pip-fallback"])
def test_installs_with_uv_where_it_installs_else_with_pip(venv_install, monkeypatch, tmp_path, uv_installs):
    calls = []

    def fake_run(cmd, **kwargs):
        calls.append(cmd)
        if cmd[1:4] == ["-m", "pip", "config"]:
            return subprocess.CompletedProcess(cmd, 0, stdout=":env:.find-links='/opt/wheels'\n", stderr="")
        failed = cmd[1:] == ["-m", "pip", "install", "-q", "uv"] and not uv_installs
        return subprocess.CompletedProcess(cmd, int(failed), stdout="", stderr="")

    monkeypatch.setattr(venv_install.subprocess, "run", fake_run)
    monkeypatch.setattr(venv_install.sys, "executable", str(tmp_path / "python"))
    assert venv_install.main(["--uninstall", "torchvision", "--", "-e", ".[test]"]) == 0
    installs = [c for c in calls if "install" in c and "uv" not in c[-1:]]
    uninstall = calls[-1]
    if uv_installs:
        (install,) = installs
        assert install[:3] == [str(tmp_path / "uv"), "pip", "install"] and install[-2:] == ["-e", ".[test]"]
        assert "--compile-bytecode" in install and "/opt/wheels" in install  # pip's find-links reach uv
        assert uninstall[:3] == [str(tmp_path / "uv"), "pip", "uninstall"] and uninstall[-1] == "torchvision"
    else:
        assert installs[-1][1:] == ["-m", "pip", "install", "-q", "--no-compile", "-e", ".[test]"]
        assert uninstall[1:] == ["-m", "pip", "uninstall", "-y", "-q", "torchvision"]
