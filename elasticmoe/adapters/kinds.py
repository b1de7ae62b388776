"""Which kind of adapter a directory holds, told by its marker file alone.

No tensor is opened here and this module imports no torch: the elastic server's ingress asks this
of a registration before it hands the path to the coordinator, which opens and checks the files.
"""

from __future__ import annotations

import os
from pathlib import Path

from elasticmoe.errors import AdapterError

EXPERT_CFG = "expert_cfg.json"  # ESFT (the ESFT repository's name)
LORA_CONFIG = "adapter_config.json"  # PEFT LoRA
ROUTER_CONFIG = "router_config.json"  # a learned router over LoRA adapters (`lora_router`)

_MARKERS = ((LORA_CONFIG, "lora"), (EXPERT_CFG, "esft"), (ROUTER_CONFIG, "lora_router"))


def adapter_kind(path: str | os.PathLike) -> str:
    """The kind of the adapter directory at `path`; `AdapterError` naming `path` when none is
    recognised (the same answer whether the path exists or not: an API caller learns nothing about
    which paths exist on the server)."""
    root = Path(path)
    for marker, kind in _MARKERS:
        if (root / marker).is_file():
            return kind
    raise AdapterError("path", f"{root}: no adapter here (want a directory with {LORA_CONFIG}, {EXPERT_CFG} "
                       f"or {ROUTER_CONFIG}, or give type)")
