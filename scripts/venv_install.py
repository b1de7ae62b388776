"""Install requirements into the venv whose python runs this script: with uv where it installs, else pip.

    .venv/bin/python scripts/venv_install.py [--uninstall NAME ...] -- -e '.[test]'

Why uv: on this project's 2-core machines pip took ~110 s to create `.venv` (`.venv-vllm` ~175 s),
compiling bytecode one file at a time and unpacking one wheel at a time; uv takes 65 s (81 s), from
a cold cache. It compiles the bytecode too (on both cores): left to the first imports, the
suite's processes each compiled what they imported, and `make test-vllm` took 203 s instead of 113.

uv does not read pip's configuration, so pip's own (`pip config list`: files and PIP_* variables,
the variables winning) is handed to it: index, extra indexes, find-links, constraints, certificate
and timeout. Those are how a machine points pip at its local wheels (here the CPU build of torch,
without which the pin resolves to the multi-GB CUDA build). uv's `unsafe-best-match` index strategy
is pip's rule: the best version across every index. If uv cannot be installed (no registry, no
wheel for the platform), pip does the work, without the bytecode compilation.
"""

from __future__ import annotations

import argparse
import os
import shlex
import subprocess
import sys
from pathlib import Path

# The sections `pip config list` shows, least to most binding for `pip install` (PIP_* variables
# show as `:env:`).
_SECTIONS = ("global", "install", ":env:")
# pip option -> (uv flag, whether pip's value is a whitespace-separated list)
_FLAGS = {
    "index-url": ("--index-url", False),
    "extra-index-url": ("--extra-index-url", True),
    "find-links": ("--find-links", True),
    "constraint": ("--constraint", True),
}


def pip_settings(python: str) -> dict[str, str]:
    """pip's effective `global`/`install` options: `{option: value}`."""
    out = subprocess.run([python, "-m", "pip", "config", "list"], capture_output=True, text=True, check=True).stdout
    ranked: dict[str, tuple[int, str]] = {}
    for line in out.splitlines():
        key, _, raw = line.partition("=")
        section, _, option = key.rpartition(".")
        if section not in _SECTIONS:
            continue
        value = " ".join(shlex.split(raw))  # pip prints the value quoted
        rank = _SECTIONS.index(section)
        if option not in ranked or rank >= ranked[option][0]:
            ranked[option] = (rank, value)
    return {option: value for option, (_, value) in ranked.items()}


def uv_arguments(settings: dict[str, str]) -> tuple[list[str], dict[str, str]]:
    """pip's settings as uv flags and environment variables."""
    flags = ["--index-strategy", "unsafe-best-match"]
    for option, (flag, is_list) in _FLAGS.items():
        if option in settings:
            for value in settings[option].split() if is_list else [settings[option]]:
                flags += [flag, value]
    env = {}
    if "cert" in settings:
        env["SSL_CERT_FILE"] = settings["cert"]
    timeout = settings.get("timeout") or settings.get("default-timeout")
    if timeout:
        env["UV_HTTP_TIMEOUT"] = timeout
    return flags, env


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--uninstall", nargs="*", default=[], metavar="NAME",
                        help="distributions to remove after installing (if present)")
    parser.add_argument("requirements", nargs="+", help="what `pip install` would take, after `--`")
    args = parser.parse_args(argv)
    python = sys.executable
    uv = Path(python).parent / "uv"
    run = subprocess.run
    if uv.exists() or run([python, "-m", "pip", "install", "-q", "uv"]).returncode == 0:
        flags, env = uv_arguments(pip_settings(python))
        print(f"installing with uv ({' '.join(flags)})", file=sys.stderr)
        run([str(uv), "pip", "install", "-q", "--compile-bytecode", "--python", python, *flags, *args.requirements],
            env={**os.environ, **env}, check=True)
        if args.uninstall:
            run([str(uv), "pip", "uninstall", "-q", "--python", python, *args.uninstall], check=True)
        return 0
    print("uv did not install; installing with pip", file=sys.stderr)
    run([python, "-m", "pip", "install", "-q", "--upgrade", "pip"], check=True)
    run([python, "-m", "pip", "install", "-q", "--no-compile", *args.requirements], check=True)
    if args.uninstall:
        run([python, "-m", "pip", "uninstall", "-y", "-q", *args.uninstall], check=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
