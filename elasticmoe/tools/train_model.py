"""Train a `make-model` preset for a few minutes on text that ships offline, so that its
routers learn real structure (expert-offloading hit rates on a random checkpoint say little).

The corpus is Python's own standard library (its `*.py` sources and, when installed, the
`pydoc_data` help topics, which are English prose): it is on every machine, needs no
network, and mixes code and text the way serving traffic mixes topics. Documents are split
deterministically by name into train and held-out parts; the held-out part supplies the
loss reported in `training.json` and the prompts of `heldout_prompts.jsonl`.

The checkpoint has exactly the layout `elasticmoe make-model` writes (same config, dtype,
generation config and tokenizer files), only the weights and the tokenizer's merges differ.

    python -m elasticmoe.tools.train_model --arch qwen3_moe --preset small --out /tmp/trained-small --minutes 8
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import random
import sys
import sysconfig
import time
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from tokenizers import Tokenizer

from elasticmoe.tools.make_model import PRESETS, save_dtype
from elasticmoe.tools.make_model import build_model as make_model_build
from elasticmoe.tools.tokenizer_builder import PAD_TOKEN, save_tokenizer, train_bpe

logger = logging.getLogger(__name__)

# Caps keep corpus loading under a second: a few MB is far more text than a few minutes of
# CPU training can consume, and a per-file cap keeps huge modules from dominating.
_MAX_FILE_BYTES = 64 * 1024
_MAX_CORPUS_BYTES = 4 * 1024 * 1024
_HELDOUT_EVERY = 10  # one document in ten (by a hash of its name) is held out
_DOC_SEPARATOR = PAD_TOKEN  # "<|endoftext|>", as GPT-style pretraining separates documents
# Per preset: (learning rate, batch size, sequence length). Eight minutes on two cores buy
# `small` only ~100-200 steps, so its rate is high too (gradients are clipped to norm 1).
_TRAIN_SHAPE = {"tiny": (3e-3, 8, 128), "tiny-vllm": (3e-3, 8, 128), "small": (3e-3, 8, 256)}
_WARMUP_STEPS = 20
_EVAL_BATCHES = 4
_PROGRESS_SECONDS = 5.0


@dataclass(frozen=True, slots=True)
class Document:
    name: str
    text: str


# ---------------------------------------------------------------------------- corpus


def _stdlib_sources() -> list[Document]:
    """The standard library's top-level modules, sorted by name so that runs agree."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    docs = []
    for path in sorted(stdlib.glob("*.py")):
        raw = path.read_bytes()[:_MAX_FILE_BYTES]
        docs.append(Document(f"stdlib/{path.name}", raw.decode("utf-8", errors="ignore")))
    return docs


def _pydoc_topics() -> list[Document]:
    """`help()`'s topic texts: English prose about Python, absent on some minimal installs."""
    try:
        from pydoc_data.topics import topics
    except ImportError:
        return []
    return [Document(f"pydoc/{name}", str(topics[name])[:_MAX_FILE_BYTES]) for name in sorted(topics)]


def load_corpus(max_bytes: int = _MAX_CORPUS_BYTES) -> list[Document]:
    """Code and prose documents, deterministic, at most about `max_bytes` of text.

    Sources and topics are interleaved before capping so that a cap keeps both kinds.
    """
    sources, topics = _stdlib_sources(), _pydoc_topics()
    mixed = [d for pair in zip(sources, topics, strict=False) for d in pair]
    shorter = min(len(sources), len(topics))
    mixed += sources[shorter:] + topics[shorter:]
    docs, total = [], 0
    for doc in mixed:
        if total >= max_bytes:
            break
        if doc.text.strip():
            docs.append(doc)
            total += len(doc.text.encode())
    return docs


def is_heldout(doc: Document) -> bool:
    """A stable hash of the name (not the position) decides, so the split of a document does
    not change when another Python version adds or drops modules."""
    return zlib.crc32(doc.name.encode()) % _HELDOUT_EVERY == 0


def split_corpus(docs: list[Document]) -> tuple[list[Document], list[Document]]:
    """(train, held-out), each in corpus order."""
    return [d for d in docs if not is_heldout(d)], [d for d in docs if is_heldout(d)]


# ---------------------------------------------------------------------------- tokenizer


def train_tokenizer(docs: list[Document], vocab_size: int) -> Tokenizer:
    """Byte-level BPE trained on `docs`, set up as `make-model`'s tokenizer (`save_tokenizer` then
    writes it identically)."""
    return train_bpe((d.text for d in docs), vocab_size)


def token_stream(tok: Tokenizer, docs: list[Document]) -> torch.Tensor:
    """All documents' tokens in one 1-D tensor, each document followed by the separator."""
    sep = tok.token_to_id(_DOC_SEPARATOR)
    if sep is None:
        raise ValueError(f"tokenizer: no {_DOC_SEPARATOR} token")
    ids: list[int] = []
    for enc in tok.encode_batch([d.text for d in docs]):
        ids += enc.ids
        ids.append(sep)
    return torch.tensor(ids, dtype=torch.long)


# ---------------------------------------------------------------------------- prompts


def heldout_prompts(tok: Tokenizer, docs: list[Document], count: int = 200, min_tokens: int = 48,
                    max_tokens: int = 96, seed: int = 0) -> list[str]:
    """`count` distinct prompts cut from held-out documents: each starts at the beginning of
    a non-blank line and is `min_tokens`..`max_tokens` tokens long. Documents take turns so
    that no single long module dominates the prompt set."""
    rng = random.Random(seed)
    starts = [[i for i, line in enumerate(d.text.splitlines(keepends=True)) if line.strip()] for d in docs]
    candidates = [(d, s) for d, s in zip(docs, starts, strict=True) if s]
    prompts: list[str] = []
    seen: set[str] = set()
    attempts = 0
    while len(prompts) < count and candidates and attempts < 20 * count:
        doc, lines = candidates[attempts % len(candidates)]
        attempts += 1
        text = "".join(doc.text.splitlines(keepends=True)[rng.choice(lines):])
        ids = tok.encode(text).ids
        want = rng.randint(min_tokens, max_tokens)
        if len(ids) < want:
            continue
        prompt = tok.decode(ids[:want])
        if prompt not in seen:
            seen.add(prompt)
            prompts.append(prompt)
    return prompts


# ---------------------------------------------------------------------------- model and training


def build_model(arch: str, preset: str, tok: Tokenizer, seed: int) -> Any:
    """The model `make_model` would build for (arch, preset), in fp32 for training."""
    return make_model_build(arch, preset, tok, seed).float()


def random_batches(stream: torch.Tensor, batch_size: int, seq_len: int, seed: int) -> Iterator[torch.Tensor]:
    """Endless [batch_size, seq_len] windows at seeded random offsets of the stream."""
    gen = torch.Generator().manual_seed(seed)
    high = len(stream) - seq_len
    if high <= 0:
        raise ValueError(f"training: corpus has {len(stream)} tokens, fewer than seq_len {seq_len}")
    while True:
        offsets = torch.randint(0, high, (batch_size,), generator=gen)
        yield torch.stack([stream[o: o + seq_len] for o in offsets.tolist()])


def fixed_batches(stream: torch.Tensor, batch_size: int, seq_len: int, count: int) -> list[torch.Tensor]:
    """`count` evenly spaced batches: the same text before and after training."""
    need = batch_size * count
    span = len(stream) - seq_len
    if span <= 0:
        raise ValueError(f"evaluation: held-out text has {len(stream)} tokens, fewer than seq_len {seq_len}")
    offsets = [span * i // max(need - 1, 1) for i in range(need)]
    windows = [stream[o: o + seq_len] for o in offsets]
    return [torch.stack(windows[i: i + batch_size]) for i in range(0, need, batch_size)]


@torch.no_grad()
def mean_loss(model: Any, batches: list[torch.Tensor]) -> float:
    """Causal-LM loss only (no load-balancing term), averaged over batches."""
    model.eval()
    losses = [float(model(input_ids=b, labels=b, output_router_logits=False).loss) for b in batches]
    model.train()
    return sum(losses) / len(losses)


def learning_rate(base: float, step: int, progress: float) -> float:
    """Linear warm-up, then cosine decay to a tenth of `base` as `progress` goes 0 -> 1
    (progress is by time or by steps, whichever budget ends first)."""
    if step < _WARMUP_STEPS:
        return base * (step + 1) / _WARMUP_STEPS
    return base * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0))))


def train_loop(model: Any, batches: Iterator[torch.Tensor], lr: float, max_steps: int | None,
               max_seconds: float) -> tuple[int, list[float], float]:
    """Train until the step or time budget ends; returns (steps, per-step losses, seconds)."""
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.1)
    model.train()
    start = last_print = time.monotonic()
    losses: list[float] = []
    tokens = 0
    step = 0
    while max_steps is None or step < max_steps:
        elapsed = time.monotonic() - start
        if elapsed >= max_seconds:
            break
        progress = max(elapsed / max_seconds, step / max_steps if max_steps else 0.0)
        for group in opt.param_groups:
            group["lr"] = learning_rate(lr, step, progress)
        batch = next(batches)
        # output_router_logits adds `router_aux_loss_coef` x load-balancing loss, which keeps
        # every expert in use instead of letting a few win early.
        loss = model(input_ids=batch, labels=batch, output_router_logits=True).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(loss.item())
        tokens += batch.numel()
        step += 1
        now = time.monotonic()
        if now - last_print >= _PROGRESS_SECONDS:
            print(f"step {step} loss {losses[-1]:.3f} lr {opt.param_groups[0]['lr']:.2e} "
                  f"tokens/s {tokens / (now - start):.0f}", file=sys.stderr, flush=True)
            last_print = now
    return step, losses, time.monotonic() - start


def save_checkpoint(model: Any, tok: Tokenizer, preset: str, out_dir: Path) -> None:
    """Same files and dtype as `make_model`."""
    model.to(save_dtype(preset)).eval()
    model.save_pretrained(out_dir)
    save_tokenizer(tok, str(out_dir))


def train_model(arch: str, preset: str, out: str | Path, minutes: float = 4.0, steps: int | None = None,
                seed: int = 0, num_prompts: int = 200, lr: float | None = None) -> dict[str, Any]:
    """Train and write the checkpoint, `heldout_prompts.jsonl` and `training.json` to `out`."""
    if arch not in PRESETS or preset not in PRESETS[arch]:
        raise ValueError(f"train-model: unknown arch/preset {arch!r}/{preset!r}")
    torch.set_num_threads(2)
    out_dir = Path(out)
    out_dir.mkdir(parents=True, exist_ok=True)
    wall_start = time.monotonic()

    docs = load_corpus()
    train_docs, heldout_docs = split_corpus(docs)
    tok = train_tokenizer(train_docs, PRESETS[arch][preset]["vocab_size"])
    train_ids, heldout_ids = token_stream(tok, train_docs), token_stream(tok, heldout_docs)
    default_lr, batch_size, seq_len = _TRAIN_SHAPE.get(preset, _TRAIN_SHAPE["small"])
    lr = lr or default_lr
    eval_batches = fixed_batches(heldout_ids, batch_size, seq_len, _EVAL_BATCHES)

    model = build_model(arch, preset, tok, seed)
    initial_heldout = mean_loss(model, eval_batches)
    logger.info("corpus %d docs (%d held out), %d train tokens; held-out loss at step 0: %.3f",
                len(docs), len(heldout_docs), len(train_ids), initial_heldout)
    step_count, losses, train_seconds = train_loop(
        model, random_batches(train_ids, batch_size, seq_len, seed), lr, steps, minutes * 60.0)
    heldout = mean_loss(model, eval_batches)
    save_checkpoint(model, tok, preset, out_dir)

    prompts = heldout_prompts(tok, heldout_docs, count=num_prompts, seed=seed)
    with (out_dir / "heldout_prompts.jsonl").open("w") as f:
        f.writelines(json.dumps({"prompt": p}) + "\n" for p in prompts)
    tail = losses[-10:]
    summary = {
        "arch": arch, "preset": preset, "seed": seed, "steps": step_count,
        "batch_size": batch_size, "seq_len": seq_len, "learning_rate": lr,
        "first_loss": losses[0] if losses else None,
        "final_loss": sum(tail) / len(tail) if tail else None,  # mean of the last 10 steps
        "initial_heldout_loss": initial_heldout, "heldout_loss": heldout,
        "train_seconds": train_seconds, "wall_seconds": time.monotonic() - wall_start,
        "corpus_bytes": sum(len(d.text.encode()) for d in docs),
        "train_docs": len(train_docs), "heldout_docs": len(heldout_docs),
        "train_tokens": len(train_ids), "heldout_tokens": len(heldout_ids), "prompts": len(prompts),
    }
    (out_dir / "training.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m elasticmoe.tools.train_model",
        description="Train a make-model preset on the Python standard library's sources and help "
                    "topics (offline), so its routers learn real structure. Writes a checkpoint with "
                    "make-model's layout plus heldout_prompts.jsonl (prompts from held-out documents) "
                    "and training.json (steps, losses, time). Training stops at --minutes or --steps, "
                    "whichever comes first.")
    parser.add_argument("--arch", default="qwen3_moe", choices=sorted(PRESETS))
    parser.add_argument("--preset", default="tiny", help="a preset of make_model.PRESETS, e.g. tiny or small")
    parser.add_argument("--out", required=True, help="output checkpoint directory")
    parser.add_argument("--minutes", type=float, default=4.0, help="training time budget (default 4)")
    parser.add_argument("--steps", type=int, default=None, help="stop after this many optimizer steps")
    parser.add_argument("--seed", type=int, default=0, help="seeds model init, batches and prompt cuts")
    parser.add_argument("--prompts", type=int, default=200, help="held-out prompts to write (default 200)")
    parser.add_argument("--lr", type=float, default=None, help="peak learning rate (default: per preset)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    summary = train_model(args.arch, args.preset, args.out, args.minutes, args.steps, args.seed, args.prompts, args.lr)
    print(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
