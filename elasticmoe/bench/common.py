"""Helpers the adapter benchmarks share: medians and ratios that skip missing values, plain
right-aligned tables, comma-list options, and the preset model (built if missing)."""

from __future__ import annotations

import argparse
import statistics
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]


def logger(name: str) -> Callable[[str], None]:
    """A progress printer to stderr, prefixed `[name]` (stdout carries the JSON)."""

    def log(msg: str) -> None:
        print(f"[{name}] {msg}", file=sys.stderr, flush=True)

    return log


def median(values: Sequence[float | None]) -> float | None:
    kept = [v for v in values if v is not None]
    return statistics.median(kept) if kept else None


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def table(title: str, header: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(header)]
    lines = [title, "  ".join(h.rjust(w) for h, w in zip(header, widths, strict=True))]
    lines += ["  ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)) for r in rows]
    return "\n".join(lines)


def fmt(v: float | None, spec: str) -> str:
    return "-" if v is None else format(v, spec)


def ints(text: str) -> list[int]:
    return [int(v) for v in text.split(",") if v]


def floats(text: str) -> list[float]:
    return [float(v) for v in text.split(",") if v]


def model_dir(args: argparse.Namespace, log: Callable[[str], None]) -> str:
    """`--model`, else `models/<--preset>-qwen3-moe`, built with `make_model` if missing."""
    if args.model is not None:
        return str(args.model)
    path = REPO_ROOT / "models" / f"{args.preset}-qwen3-moe"
    if not (path / "config.json").exists():
        from elasticmoe.tools.make_model import make_model

        log(f"building {path}")
        make_model("qwen3_moe", args.preset, seed=0, out=str(path))
    return str(path)
