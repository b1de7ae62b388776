"""Record a `RoutingTrace` offline: run `transformers`' own model on a checkpoint made by
`elasticmoe make-model` and keep what its routers did (`output_router_logits=True`).

Prompts are generated, topical text: the words of the checkpoint's tokenizer are split
into `num_topics` topics; a prompt draws most of its words from its topic and the rest from
all words. Random-weight routers still route by token, so prompts of one topic share
routing tendencies the way real prompts on one subject do (FineMoE §4.2.3); a uniform
corpus would make every prompt look alike.

Per request the trace holds one prefill iteration (the prompt, `prompt_tokens` tokens) and
`new_tokens` decode iterations (one sampled token each: temperature and top-k sampling,
seeded, because greedy decoding of a random model repeats itself).

The semantic embedding (FineMoE §4.2.1 uses the embedding layer's output) is the model's
own input-embedding layer, mean-pooled over the prompt's tokens (per iteration: over the
tokens that iteration feeds). It needs no separate embedding model and no network, and it is
exactly what an engine has in hand at no cost.

Mixtral-Offloading's speculation needs layer l+1's gate applied to layer l's router input;
forward hooks on the gates capture those inputs, and the trace keeps the result.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import torch

from elasticmoe.offload.trace import RoutingTrace

_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclass(frozen=True, slots=True)
class PromptSpec:
    num_requests: int = 64
    prompt_tokens: int = 32
    new_tokens: int = 32
    num_topics: int = 8
    topic_share: float = 0.8  # of a prompt's words drawn from its own topic
    seed: int = 0

    def __post_init__(self) -> None:
        if min(self.num_requests, self.prompt_tokens, self.num_topics) < 1 or self.new_tokens < 0:
            raise ValueError(f"prompt spec: counts must be >= 1 (new_tokens >= 0), got {self}")
        if not 0.0 <= self.topic_share <= 1.0:
            raise ValueError(f"prompt spec: topic_share must be in [0, 1], got {self.topic_share}")


def vocabulary_words(tokenizer: Any) -> list[str]:
    """The whole words (3+ lowercase letters) the tokenizer holds as one word-initial token
    (byte-level BPE: the token carries the leading space), sorted."""
    words = set()
    for token in tokenizer.get_vocab():
        text = tokenizer.convert_tokens_to_string([token])
        word = text[1:]
        if text.startswith(" ") and len(word) >= 3 and word.isalpha() and word.islower():
            words.add(word)
    return sorted(words)


def topical_prompts(words: list[str], spec: PromptSpec) -> list[tuple[int, str]]:
    """`spec.num_requests` (topic, text) pairs, each text long enough for `prompt_tokens`."""
    if len(words) < spec.num_topics:
        raise ValueError(f"prompts: {len(words)} words cannot make {spec.num_topics} topics")
    rng = random.Random(spec.seed)
    pool = words[:]
    rng.shuffle(pool)
    topics = [pool[t:: spec.num_topics] for t in range(spec.num_topics)]
    prompts = []
    for _ in range(spec.num_requests):
        topic = rng.randrange(spec.num_topics)
        # Words are at least one token each: this many words always cover the prompt.
        chosen = [rng.choice(topics[topic]) if rng.random() < spec.topic_share else rng.choice(pool)
                  for _ in range(spec.prompt_tokens)]
        prompts.append((topic, " ".join(chosen).capitalize() + "."))
    return prompts


def _moe_gates(model: Any) -> list[torch.nn.Module]:
    gates = [getattr(getattr(layer, "mlp", None), "gate", None) for layer in model.model.layers]
    if not gates or any(g is None or getattr(g, "weight", None) is None for g in gates):
        raise ValueError("trace recorder: every decoder layer needs an `mlp.gate` router with a weight "
                         "(Qwen3-MoE / Mixtral checkpoints)")
    return [g for g in gates if g is not None]


def _expert_bytes(model_dir: Path, config: Any) -> int:
    saved = json.loads((model_dir / "config.json").read_text())
    dtype = str(saved.get("dtype") or saved.get("torch_dtype") or "float32")
    inter = getattr(config, "moe_intermediate_size", None) or config.intermediate_size
    return 3 * config.hidden_size * inter * _DTYPE_BYTES.get(dtype, 4)


def _sample(logits: torch.Tensor, generator: torch.Generator, temperature: float, top_k: int) -> torch.Tensor:
    """[b, V] -> next token ids [b, 1]."""
    values, ids = torch.topk(logits.float() / temperature, top_k, dim=-1)
    choice = torch.multinomial(torch.softmax(values, dim=-1), 1, generator=generator)
    return ids.gather(1, choice)


@torch.no_grad()
def record_trace(model_dir: str | Path, spec: PromptSpec, batch_size: int = 16, temperature: float = 1.0,
                 sample_top_k: int = 40) -> RoutingTrace:
    """Run the prompts of `spec` through the checkpoint at `model_dir` and return the trace."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model_dir = Path(model_dir)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    cfg = model.config
    num_experts = getattr(cfg, "num_experts", None) or cfg.num_local_experts
    top_k = cfg.num_experts_per_tok
    gates = _moe_gates(model)
    embed = model.get_input_embeddings()

    prompts = topical_prompts(vocabulary_words(tokenizer), spec)
    ids = [tokenizer(text, add_special_tokens=False).input_ids[: spec.prompt_tokens] for _, text in prompts]
    if any(len(i) < spec.prompt_tokens for i in ids):
        raise ValueError(f"trace recorder: a prompt tokenized to fewer than {spec.prompt_tokens} tokens")
    prompt_ids = torch.tensor(ids)  # [R, P]

    router_inputs: dict[int, torch.Tensor] = {}
    hooks = [g.register_forward_hook(lambda _m, args, _out, i=i: router_inputs.__setitem__(i, args[0].detach()))
             for i, g in enumerate(gates)]
    gate_weights = [cast(torch.Tensor, g.weight).float() for g in gates]  # [E, H] each
    generator = torch.Generator().manual_seed(spec.seed)
    per_request: list[list[dict[str, torch.Tensor]]] = []  # request -> its iterations
    try:
        for start in range(0, spec.num_requests, batch_size):
            batch_ids = prompt_ids[start: start + batch_size]
            b = batch_ids.shape[0]
            iters: list[list[dict[str, torch.Tensor]]] = [[] for _ in range(b)]
            step_ids, cache = batch_ids, None
            for _ in range(spec.new_tokens + 1):  # the prefill, then one step per new token
                out = model(input_ids=step_ids, cache=cache, use_cache=True, output_router_logits=True)
                cache = out.cache
                t = step_ids.shape[1]
                probs = torch.stack([torch.softmax(lg.float(), dim=-1) for lg in out.router_logits], dim=1)
                spec_probs = torch.zeros_like(probs)  # [b*t, L, E]
                for layer in range(len(gates) - 1):
                    spec_probs[:, layer] = torch.softmax(router_inputs[layer].float() @ gate_weights[layer + 1].T, -1)
                topk = torch.topk(probs, top_k, dim=-1).indices
                emb = embed(step_ids).float()  # [b, t, H]
                for j in range(b):
                    rows = slice(j * t, (j + 1) * t)
                    iters[j].append({"gate_probs": probs[rows], "topk_ids": topk[rows], "next_gate_probs": spec_probs[rows],
                                     "embedding": emb[j].mean(dim=0)})
                step_ids = _sample(out.logits[:, -1], generator, temperature, sample_top_k)
            per_request += iters
    finally:
        for hook in hooks:
            hook.remove()

    flat = [it for request in per_request for it in request]
    return RoutingTrace(
        num_layers=len(gates), num_experts=num_experts, top_k=top_k,
        expert_bytes=_expert_bytes(model_dir, cfg),
        gate_probs=torch.cat([it["gate_probs"] for it in flat]),
        topk_ids=torch.cat([it["topk_ids"] for it in flat]).long(),
        next_gate_probs=torch.cat([it["next_gate_probs"] for it in flat]),
        iteration_request=torch.tensor([r for r, request in enumerate(per_request) for _ in request]),
        iteration_num_tokens=torch.tensor([it["gate_probs"].shape[0] for it in flat]),
        iteration_embedding=torch.stack([it["embedding"] for it in flat]),
        prompt_embedding=torch.stack([request[0]["embedding"] for request in per_request]),
        meta={"model": str(model_dir), "model_type": cfg.model_type, "num_requests": spec.num_requests,
              "prompt_tokens": spec.prompt_tokens, "new_tokens": spec.new_tokens, "num_topics": spec.num_topics,
              "topic_share": spec.topic_share, "seed": spec.seed, "temperature": temperature,
              "sample_top_k": sample_top_k, "topics": [topic for topic, _ in prompts]},
    )
