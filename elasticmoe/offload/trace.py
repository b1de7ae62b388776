"""A routing trace: what a model's routers did for a set of requests, iteration by
iteration (a prefill, then one decode iteration per generated token), enough to replay
any offloading policy against it (`replay`).

Tokens of all iterations are concatenated along one axis N; iteration i owns rows
`[token_offset(i), token_offset(i) + iteration_num_tokens[i])`, and the iterations of a
request are consecutive, its prefill first.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch


@dataclass(frozen=True, slots=True, eq=False)
class RoutingTrace:
    num_layers: int
    num_experts: int
    top_k: int
    expert_bytes: int  # one routed expert's weights (gate, up, down) as stored
    gate_probs: torch.Tensor  # [N, L, E] softmax over all experts
    topk_ids: torch.Tensor  # [N, L, k] the experts each token ran
    # [N, L, E]: row l is layer l+1's gate applied to layer l's router input (Mixtral-Offloading's
    # speculation); row L-1 is zeros. None when not recorded.
    next_gate_probs: torch.Tensor | None
    iteration_request: torch.Tensor  # [I] request index of each iteration
    iteration_num_tokens: torch.Tensor  # [I]
    iteration_embedding: torch.Tensor  # [I, h] mean input embedding of the iteration's tokens
    prompt_embedding: torch.Tensor  # [R, h] mean input embedding of each prompt
    meta: dict[str, Any] = field(default_factory=dict)  # how the trace was made (JSON-able)
    _offsets: torch.Tensor = field(init=False, repr=False)

    def __post_init__(self) -> None:
        n, shape = self.gate_probs.shape[0], (self.num_layers, self.num_experts)
        if tuple(self.gate_probs.shape[1:]) != shape:
            raise ValueError(f"trace: gate_probs must be [N, {shape[0]}, {shape[1]}], got {tuple(self.gate_probs.shape)}")
        if tuple(self.topk_ids.shape) != (n, self.num_layers, self.top_k):
            raise ValueError(f"trace: topk_ids must be [{n}, {self.num_layers}, {self.top_k}], "
                             f"got {tuple(self.topk_ids.shape)}")
        if self.next_gate_probs is not None and self.next_gate_probs.shape != self.gate_probs.shape:
            raise ValueError("trace: next_gate_probs must have gate_probs' shape")
        num_iters = self.iteration_request.numel()
        if self.iteration_num_tokens.numel() != num_iters or self.iteration_embedding.shape[0] != num_iters:
            raise ValueError("trace: one request index, token count and embedding per iteration")
        if int(self.iteration_num_tokens.sum()) != n or bool((self.iteration_num_tokens < 1).any()):
            raise ValueError(f"trace: iteration token counts (each >= 1) must sum to N = {n}")
        requests = self.iteration_request
        if num_iters and (bool((requests[1:] < requests[:-1]).any()) or int(requests.max()) >= self.num_requests):
            raise ValueError("trace: iterations must be grouped by request, in request order")
        offsets = torch.zeros(num_iters + 1, dtype=torch.long)
        offsets[1:] = torch.cumsum(self.iteration_num_tokens, 0)
        object.__setattr__(self, "_offsets", offsets)

    @property
    def num_requests(self) -> int:
        return int(self.prompt_embedding.shape[0])

    @property
    def num_iterations(self) -> int:
        return int(self.iteration_request.numel())

    def token_slice(self, iteration: int) -> slice:
        return slice(int(self._offsets[iteration]), int(self._offsets[iteration + 1]))

    def iterations_of(self, request: int) -> range:
        ids = torch.nonzero(self.iteration_request == request).flatten()
        return range(int(ids[0]), int(ids[-1]) + 1) if ids.numel() else range(0)

    def with_experts_renumbered(self, new_id: torch.Tensor) -> RoutingTrace:
        """The same requests routed to other experts, as on a new domain: what expert e did, expert
        `new_id[e]` does, in every layer (`new_id` a permutation of 0..E-1). The embeddings stay."""
        if sorted(new_id.tolist()) != list(range(self.num_experts)):
            raise ValueError(f"renumbering: need a permutation of 0..{self.num_experts - 1}")
        old_id = torch.argsort(new_id)  # column j of the new distributions is old expert old_id[j]
        return RoutingTrace(self.num_layers, self.num_experts, self.top_k, self.expert_bytes,
                            self.gate_probs[..., old_id], new_id[self.topk_ids],
                            None if self.next_gate_probs is None else self.next_gate_probs[..., old_id],
                            self.iteration_request, self.iteration_num_tokens, self.iteration_embedding,
                            self.prompt_embedding, meta={**self.meta, "renumbered": new_id.tolist()})

    def save(self, path: str | Path) -> None:
        arrays = {name: getattr(self, name).numpy() for name in _TENSORS if getattr(self, name) is not None}
        header = {"num_layers": self.num_layers, "num_experts": self.num_experts, "top_k": self.top_k,
                  "expert_bytes": self.expert_bytes, "meta": self.meta}
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        with open(path, "wb") as f:
            np.savez_compressed(f, header=np.array(json.dumps(header)), **arrays)

    @classmethod
    def load(cls, path: str | Path) -> RoutingTrace:
        with np.load(path) as data:
            header = json.loads(str(data["header"]))
            tensors = {name: torch.from_numpy(data[name]) if name in data else None for name in _TENSORS}
        return cls(header["num_layers"], header["num_experts"], header["top_k"], header["expert_bytes"],
                   meta=header["meta"], **tensors)  # type: ignore[arg-type]


_TENSORS = ("gate_probs", "topk_ids", "next_gate_probs", "iteration_request", "iteration_num_tokens",
            "iteration_embedding", "prompt_embedding")
