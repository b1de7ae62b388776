"""MoLoRA's learned router (§4.3): per-token top-k weighting over a set of LoRA adapters.

    g(x) = W2 · GELU(W1 x + b1) + b2            (2-layer MLP, hidden 64; eq. 9)
    w = softmax(TopK(g(x), k)),  Δh = Σ_j w_j · x A_j B_j   over the top-k adapters (eq. 8)

Files: `router_config.json` (`{"adapters": [names], "top_k": k, "hidden": 64}`) and
`router.safetensors` (`w1` [hidden, d], `b1`, `w2` [K, hidden], `b2`). Here `x` is the
token's input embedding (the layer-0 hidden state): one routing decision per token,
applied at every LoRA site of the step.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from elasticmoe.adapters.kinds import ROUTER_CONFIG as CONFIG

WEIGHTS = "router.safetensors"


@dataclass(frozen=True)
class LoraRouter:
    adapters: tuple[str, ...]
    top_k: int
    w1: torch.Tensor
    b1: torch.Tensor
    w2: torch.Tensor
    b2: torch.Tensor

    def __post_init__(self) -> None:
        k = len(self.adapters)
        if k < 1 or len(set(self.adapters)) != k:
            raise ValueError("adapters: one or more distinct adapter names")
        if not 1 <= self.top_k <= k:
            raise ValueError(f"top_k: must be in [1, {k}], got {self.top_k}")
        hidden = self.w1.shape[0]
        if self.b1.shape != (hidden,) or self.w2.shape != (k, hidden) or self.b2.shape != (k,):
            raise ValueError("router weights: want w1 [h, d], b1 [h], w2 [K, h], b2 [K]")

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """g(x): x [n, d] -> adapter logits [n, K] (eq. 9)."""
        h = F.gelu(F.linear(x.float(), self.w1.float(), self.b1.float()))
        return F.linear(h, self.w2.float(), self.b2.float())

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [n, d] -> (adapter indexes [n, k], weights [n, k]): softmax over the top-k logits (eq. 8)."""
        top = self.logits(x).topk(self.top_k, dim=-1)
        return top.indices, torch.softmax(top.values, dim=-1)

    @classmethod
    def open(cls, path: str | Path) -> LoraRouter:
        """Read a router directory; `ValueError` naming `path` if it is not one."""
        root = Path(path)
        try:
            cfg = json.loads((root / CONFIG).read_text())
            w = load_file(str(root / WEIGHTS))
            return cls(tuple(cfg["adapters"]), int(cfg["top_k"]), w["w1"], w["b1"], w["w2"], w["b2"])
        except (OSError, KeyError, TypeError, ValueError) as exc:  # one message: no hint of what exists
            raise ValueError(f"path: {root}: no LoRA router here (want {CONFIG} and {WEIGHTS})") from exc

    def save(self, path: str | Path) -> Path:
        root = Path(path)
        root.mkdir(parents=True, exist_ok=True)
        (root / CONFIG).write_text(json.dumps({"adapters": list(self.adapters), "top_k": self.top_k,
                                               "hidden": int(self.w1.shape[0])}, indent=2))
        save_file({"w1": self.w1.contiguous(), "b1": self.b1, "w2": self.w2.contiguous(), "b2": self.b2},
                  str(root / WEIGHTS))
        return root


def random_router(adapters: tuple[str, ...], hidden_size: int, top_k: int, seed: int = 0,
                  hidden: int = 64) -> LoraRouter:
    """An untrained router with seeded random weights (tests and benchmarks)."""
    g = torch.Generator().manual_seed(seed)
    k = len(adapters)
    return LoraRouter(adapters, top_k, torch.randn(hidden, hidden_size, generator=g) / hidden_size**0.5,
                      torch.zeros(hidden), torch.randn(k, hidden, generator=g), torch.zeros(k))
