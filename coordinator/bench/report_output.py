"""How a benchmark hands back its results: the JSON document alone on stdout (`--json`),
also in a file (`--out`), a PNG (`--plot`), and the human-readable tables and progress lines on stderr.

Ray writes to file descriptor 1 (raylet messages at shutdown), so `claim_stdout()` keeps
a private copy of stdout for the document and points fd 1 at stderr; call it before Ray starts.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TextIO


def progress_printer(name: str) -> Callable[[str], None]:
    """A benchmark's progress lines: `[name HH:MM:SS] message` on stderr, flushed at once."""

    def progress(msg: str) -> None:
        print(f"[{name} {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)

    return progress


def claim_stdout() -> TextIO:
    """A writer to the real stdout; from now on anything else written to fd 1 goes to stderr."""
    sys.stdout.flush()
    out = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    return out


def emit(doc: dict[str, Any], tables: str, stdout: TextIO, *, as_json: bool, out_path: str | None,
         plot_path: str | None, plot: Callable[[dict[str, Any], str], None],
         progress: Callable[[str], None]) -> None:
    """Tables to stderr, then the JSON document to `out_path` and/or `stdout`, and the plot."""
    print(tables, file=sys.stderr)
    text = json.dumps(doc, indent=2)
    if out_path:
        Path(out_path).write_text(text + "\n")
    if plot_path:
        plot(doc, plot_path)
        progress(f"plot written to {plot_path}")
    if as_json:
        print(text, file=stdout)
    stdout.close()
