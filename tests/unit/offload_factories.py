"""Hand-made inputs for the offloading tests: routing traces (k = 1: each token names one expert
per layer) and a small bf16 checkpoint of experts read by `DiskExperts`."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import save_file

from elasticmoe.engine.expert_sources import DiskExperts, LayerExpertSpecs
from elasticmoe.models.weights import ParamSpec
from elasticmoe.offload.trace import RoutingTrace

ROUTED_PROB = 0.7  # the routed expert's gate probability; the rest is spread evenly


def make_trace(routes: list[list[list[list[int]]]], embeddings: list[list[float]] | None = None,
               num_experts: int = 4, speculate: bool = False) -> RoutingTrace:
    """`routes[r][i][t][l]`: the expert token t of iteration i of request r runs at layer l.
    `embeddings[r]`: request r's prompt embedding (default: one-hot of r, h = 4).
    `speculate`: record a perfect next-layer guess (row l = layer l+1's gate probabilities)."""
    num_layers = len(routes[0][0][0])
    rest = (1.0 - ROUTED_PROB) / (num_experts - 1)
    ids = torch.tensor([tok for request in routes for it in request for tok in it])  # [N, L]
    probs = torch.full((*ids.shape, num_experts), rest).scatter_(2, ids[..., None], ROUTED_PROB)
    next_probs = None
    if speculate:
        next_probs = torch.zeros_like(probs)
        next_probs[:, :-1] = probs[:, 1:]
    if embeddings is None:
        embeddings = [[float(r == j) for j in range(4)] for r in range(len(routes))]
    prompt_emb = torch.tensor(embeddings)
    num_tokens = [len(it) for request in routes for it in request]
    requests = [r for r, request in enumerate(routes) for _ in request]
    return RoutingTrace(num_layers, num_experts, 1, expert_bytes=1000, gate_probs=probs, topk_ids=ids[..., None],
                        next_gate_probs=next_probs, iteration_request=torch.tensor(requests),
                        iteration_num_tokens=torch.tensor(num_tokens), iteration_embedding=prompt_emb[requests],
                        prompt_embedding=prompt_emb, meta={"model_type": "hand-made"})


def cyclic_request(num_iterations: int = 3) -> list[list[list[int]]]:
    """One token per iteration running expert l at layer l (3 layers): a cycle of 3 experts."""
    return [[[0, 1, 2]] for _ in range(num_iterations)]


def mixed_routes(seed: int = 0, num_requests: int = 4) -> list[list[list[list[int]]]]:
    """Requests of a 3-token prefill and 3 decode tokens, random routing over 3 layers x 4 experts."""
    gen = torch.Generator().manual_seed(seed)

    def tokens(n: int) -> list[list[int]]:
        return torch.randint(0, 4, (n, 3), generator=gen).tolist()

    return [[tokens(3), *(tokens(1) for _ in range(3))] for _ in range(num_requests)]


def bf16_disk_experts(directory: Path, num_experts: int = 2, shape: tuple[int, int] = (3, 4),
                      ) -> tuple[dict[str, torch.Tensor], DiskExperts, ParamSpec, ParamSpec]:
    """`num_experts` experts (gate, up `shape` -> w13 rows [2 * rows, cols]; down -> w2 rows `shape`)
    saved in bf16 in `directory`, their tensors by name, and the disk tier over them with its two
    specs (default: two experts of [3, 4])."""
    gen = torch.Generator().manual_seed(1)
    experts = tuple(range(num_experts))
    names = {f"e{e}.{p}": torch.randn(*shape, generator=gen).bfloat16() for e in experts for p in ("gate", "up", "down")}
    save_file(names, str(directory / "model.safetensors"))
    rows, cols = shape
    w13 = ParamSpec("w13", (num_experts, 2 * rows, cols), tuple((f"e{e}.gate", f"e{e}.up") for e in experts),
                    expert_ids=experts)
    w2 = ParamSpec("w2", (num_experts, rows, cols), tuple((f"e{e}.down",) for e in experts), expert_ids=experts)
    return names, DiskExperts(str(directory), [LayerExpertSpecs(w13, w2)]), w13, w2
