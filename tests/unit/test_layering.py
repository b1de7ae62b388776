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


def _imports_within(package: str) -> dict[str, set[str]]:
    """module -> the modules of `package` it imports (top-level and function-level, not those
    under `if TYPE_CHECKING:`, which never run), read from the source with `ast`."""
    import ast
    from pathlib import Path

    root = Path(__file__).resolve().parents[2] / package
    graph: dict[str, set[str]] = {}
    for path in root.rglob("*.py"):
        module = ".".join(path.relative_to(root.parent).with_suffix("").parts).removesuffix(".__init__")
        tree = ast.parse(path.read_text())
        skipped = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If)
                   and ast.unparse(node.test) == "TYPE_CHECKING" for n in ast.walk(node)}
        names: set[str] = set()
        for node in ast.walk(tree):
            if id(node) in skipped:
                continue
            if isinstance(node, ast.ImportFrom) and node.module:
                names.add(node.module)
            elif isinstance(node, ast.Import):
                names.update(a.name for a in node.names)
        graph[module] = {n for n in names if n == package or n.startswith(package + ".")}
    return graph


def test_no_import_cycle_inside_the_coordinator():
    graph = _imports_within("coordinator")
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(module: str, path: list[str]) -> None:
        state[module] = 1
        for dep in sorted(graph.get(module, ())):
            assert state.get(dep) != 1, f"import cycle: {' -> '.join([*path, module, dep])}"
            if dep in graph and dep not in state:
                visit(dep, [*path, module])
        state[module] = 2

    for module in sorted(graph):
        if module not in state:
            visit(module, [])


def test_the_models_import_nothing_from_the_adapters():
    """Adapters attach to the models from outside through the hooks the models define
    (`ExpertsHook`, the LoRA sites, `reroute`); no import points back, not even for types."""
    import ast
    from pathlib import Path

    root = Path(__file__).resolve().parents[2] / "elasticmoe" / "models"
    bad = []
    for path in root.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [node.module or ""] if isinstance(node, ast.ImportFrom) else [
                a.name for a in node.names] if isinstance(node, ast.Import) else []
            bad += [f"{path.name}: {n}" for n in names if n.startswith("elasticmoe.adapters")]
    assert not bad, bad
