"""The dependency direction of DESIGN.md: the core (`elasticmoe`, but its CLI) imports neither
Ray nor hmm / imm / coordinator."""

from __future__ import annotations

import pkgutil
import subprocess
import sys

import elasticmoe


def test_the_core_imports_nothing_above_it():
    modules = [m.name for m in pkgutil.walk_packages(elasticmoe.__path__, "elasticmoe.") if m.name != "elasticmoe.cli"]
    code = (
        "import importlib, sys\n"
        f"for name in {modules!r}:\n"
        "    importlib.import_module(name)\n"
        "bad = sorted({m.split('.')[0] for m in sys.modules} & {'hmm', 'imm', 'coordinator', 'ray'})\n"
        "print(','.join(bad))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "", f"the core imports {out.stdout.strip()}"
