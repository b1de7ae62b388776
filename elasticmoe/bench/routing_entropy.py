"""Fine- vs coarse-grained routing entropy (FineMoE §2.3, Fig. 3).

FineMoE calls the expert pattern of one inference iteration (the prefill, or one decode
step) *fine-grained* and the pattern aggregated over all iterations of a request
*coarse-grained* (what MoE-Infinity tracks). Per MoE layer it takes the Shannon entropy of
each: a low fine-grained entropy next to a high coarse-grained one means routing is
predictable per iteration but blurred at request level, which is the case for
iteration-level expert prefetching. Fig. 3(c) is the entropy of the pattern aggregated over
the first t iterations, rising with t; `cumulative` reproduces it.

Two readings of "expert pattern" are computed:
- `probs`: the gate's softmax distribution, averaged over the iteration's tokens (FineMoE's
  expert map stores these probabilities);
- `topk`: the share of the iteration's top-k activations each expert got (expert hit counts,
  the paper's heatmaps). A one-token decode step then always has entropy log k.

Request-level aggregation weights every iteration equally, so a long prefill does not
drown the decode steps. Entropies are in nats; the maximum is log(num_experts).

    python -m elasticmoe.bench.routing_entropy --model /tmp/trained-small --prompts 64 --json
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

_EPS = 1e-12


@dataclass(frozen=True, slots=True)
class RoutingEntropy:
    """Per-layer entropies of one request (or a mean over requests), in nats."""

    fine: list[float]  # mean over iterations of the iteration's entropy
    coarse: list[float]  # entropy of the request-level (iteration-averaged) distribution
    cumulative: list[list[float]]  # [t][layer]: entropy of the first t+1 iterations' aggregate

    @property
    def fine_mean(self) -> float:
        return sum(self.fine) / len(self.fine)

    @property
    def coarse_mean(self) -> float:
        return sum(self.coarse) / len(self.coarse)


def entropy(dist: torch.Tensor) -> torch.Tensor:
    """Shannon entropy (nats) over the last dim of distributions that each sum to 1."""
    return -(dist * torch.log(dist.clamp_min(_EPS))).sum(dim=-1)


def iteration_distribution(gate_probs: torch.Tensor, top_k: int | None = None) -> torch.Tensor:
    """[tokens, layers, experts] gate probabilities of one iteration -> [layers, experts].

    With `top_k`, each token contributes 1/k to each of its k chosen experts (activation
    shares); without, its whole probability vector (the expert map's view).
    """
    if gate_probs.dim() != 3 or gate_probs.shape[0] == 0:
        raise ValueError(f"routing entropy: expected [tokens>0, layers, experts], got {tuple(gate_probs.shape)}")
    probs = gate_probs.float()
    if top_k is not None:
        chosen = torch.topk(probs, top_k, dim=-1).indices
        probs = torch.zeros_like(probs).scatter_(-1, chosen, 1.0 / top_k)
    return probs.mean(dim=0)


def routing_entropy(gate_probs_per_iteration: Sequence[torch.Tensor], top_k: int | None = None) -> RoutingEntropy:
    """Fine- and coarse-grained entropy per layer of one request.

    `gate_probs_per_iteration[i]` is iteration i's [tokens, layers, experts] gate
    probabilities (iteration 0 the prefill). See `iteration_distribution` for `top_k`.
    """
    if not gate_probs_per_iteration:
        raise ValueError("routing entropy: a request needs at least one iteration")
    dists = torch.stack([iteration_distribution(p, top_k) for p in gate_probs_per_iteration])  # [I, L, E]
    running = dists.cumsum(dim=0) / torch.arange(1, len(dists) + 1).view(-1, 1, 1)
    cumulative = entropy(running)  # [I, L]
    return RoutingEntropy(
        fine=entropy(dists).mean(dim=0).tolist(),
        coarse=cumulative[-1].tolist(),
        cumulative=cumulative.tolist(),
    )


def mean_entropy(results: Sequence[RoutingEntropy]) -> RoutingEntropy:
    """Per-layer means over requests; `cumulative` is averaged over the requests that reach t."""
    if not results:
        raise ValueError("routing entropy: no requests")
    layers = len(results[0].fine)
    longest = max(len(r.cumulative) for r in results)
    cumulative = []
    for t in range(longest):
        rows = [r.cumulative[t] for r in results if len(r.cumulative) > t]
        cumulative.append([sum(row[layer] for row in rows) / len(rows) for layer in range(layers)])
    return RoutingEntropy(
        fine=[sum(r.fine[layer] for r in results) / len(results) for layer in range(layers)],
        coarse=[sum(r.coarse[layer] for r in results) / len(results) for layer in range(layers)],
        cumulative=cumulative,
    )


# ---------------------------------------------------------------------------- measurement


def load_prompts(source: Path, count: int) -> list[str]:
    """The first `count` prompts of a `heldout_prompts.jsonl` (or of the one inside a directory)."""
    path = source / "heldout_prompts.jsonl" if source.is_dir() else source
    with path.open() as f:
        prompts = [json.loads(line)["prompt"] for line in f if line.strip()]
    return prompts[:count]


def generated_prompts(tokenizer: Any, count: int, seed: int) -> list[str]:
    """For checkpoints without held-out prompts (random `make-model` ones): topical prompts
    from `offload_trace`, so that the two benches see the same kind of input."""
    from elasticmoe.bench.offload_trace import PromptSpec, topical_prompts, vocabulary_words

    spec = PromptSpec(num_requests=count, prompt_tokens=64, seed=seed)
    return [text for _, text in topical_prompts(vocabulary_words(tokenizer), spec)]


def _gate_probs(router_logits: Sequence[torch.Tensor]) -> torch.Tensor:
    """Per-layer router logits [tokens, E] -> [tokens, layers, E] probabilities."""
    return torch.stack([torch.softmax(lg.float(), dim=-1) for lg in router_logits], dim=1)


def _next_token(logits: torch.Tensor, generator: torch.Generator, temperature: float) -> torch.Tensor:
    """[1, V] -> [1, 1]: greedy at temperature 0, else sampled."""
    if temperature <= 0:
        return logits.argmax(dim=-1, keepdim=True)
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    return torch.multinomial(probs, 1, generator=generator)


@torch.no_grad()
def request_gate_probs(model: Any, prompt_ids: list[int], new_tokens: int, generator: torch.Generator,
                       temperature: float) -> list[torch.Tensor]:
    """Run one request (prefill + `new_tokens` decode steps, batch of one so no padding
    enters the statistics) and return each iteration's [tokens, layers, E] gate probabilities."""
    step_ids = torch.tensor([prompt_ids])
    cache = None
    iterations = []
    for _ in range(new_tokens + 1):
        out = model(input_ids=step_ids, cache=cache, use_cache=True, output_router_logits=True)
        cache = out.cache
        iterations.append(_gate_probs(out.router_logits))
        step_ids = _next_token(out.logits[:, -1], generator, temperature)
    return iterations


def measure(model_dir: str | Path, num_prompts: int = 64, new_tokens: int = 16, temperature: float = 0.0,
            seed: int = 0, prompts_from: str | Path | None = None) -> dict[str, Any]:
    """Routing entropies of the checkpoint over held-out prompts, as a JSON-ready dict."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model_dir = Path(model_dir)
    torch.set_num_threads(2)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    source = Path(prompts_from) if prompts_from else model_dir
    has_file = (source / "heldout_prompts.jsonl").is_file() if source.is_dir() else source.is_file()
    prompts = load_prompts(source, num_prompts) if has_file else generated_prompts(tokenizer, num_prompts, seed)
    generator = torch.Generator().manual_seed(seed)
    top_k = model.config.num_experts_per_tok
    by_mode: dict[str, list[RoutingEntropy]] = {"probs": [], "topk": []}
    for text in prompts:
        ids = tokenizer(text, add_special_tokens=False).input_ids
        iterations = request_gate_probs(model, ids, new_tokens, generator, temperature)
        by_mode["probs"].append(routing_entropy(iterations))
        by_mode["topk"].append(routing_entropy(iterations, top_k=top_k))
    num_experts = iterations[0].shape[-1]
    report: dict[str, Any] = {
        "model": str(model_dir), "prompts": len(prompts),
        "prompt_source": str(source) if has_file else "generated (offload_trace topical prompts)",
        "new_tokens": new_tokens, "temperature": temperature, "num_experts": num_experts, "top_k": top_k,
        "max_entropy": math.log(num_experts),
    }
    for mode, results in by_mode.items():
        mean = mean_entropy(results)
        report[mode] = {
            "fine_mean": mean.fine_mean, "coarse_mean": mean.coarse_mean,
            "fine_per_layer": mean.fine, "coarse_per_layer": mean.coarse,
            # Fig. 3(c): layer-averaged entropy of the pattern aggregated over iterations 1..t.
            "cumulative_mean": [sum(row) / len(row) for row in mean.cumulative],
        }
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m elasticmoe.bench.routing_entropy",
        description="Fine-grained (per-iteration) vs coarse-grained (request-level) routing entropy "
                    "per MoE layer, as in FineMoE Fig. 3, over held-out prompts run through "
                    "transformers' model (prefill plus decode steps). Lower fine-grained entropy means "
                    "per-iteration routing is more predictable.")
    parser.add_argument("--model", required=True, help="checkpoint directory")
    parser.add_argument("--prompts", type=int, default=64, help="number of prompts (default 64)")
    parser.add_argument("--prompts-from", default=None,
                        help="heldout_prompts.jsonl or a directory holding one (default: --model's; "
                             "topical generated prompts when there is none)")
    parser.add_argument("--new-tokens", type=int, default=16, help="decode iterations per request (default 16)")
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default), else sampled")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true", help="print the full JSON report")
    args = parser.parse_args(argv)
    report = measure(args.model, args.prompts, args.new_tokens, args.temperature, args.seed, args.prompts_from)
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        for mode in ("probs", "topk"):
            r = report[mode]
            print(f"{mode:5s} fine {r['fine_mean']:.3f}  coarse {r['coarse_mean']:.3f}  "
                  f"(max {report['max_entropy']:.3f} nats)", file=sys.stdout)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
