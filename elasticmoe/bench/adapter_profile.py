"""The offline profiler (CoServe §4.5): measure a device's performance matrix per adapter kind on a
real engine and write the profile JSON the online policies read.

    python -m elasticmoe.bench.adapter_profile --model models/tiny-qwen3-moe --out profile.json \
        [--lora DIR] [--esft DIR] [--usage NAME=P ...] [--kind NAME=esft ...] [--sample FILE] [--budget-gb G]

Per kind ("base", "lora", "esft", and "expert" for offloaded base experts), one adapter stands
for all of its kind (CoServe: "experts of the same model architecture are profiled only once";
every LoRA slot has the padded shape of `max_lora_rank`):

- batch latency: for each batch size b in `--batch-sizes`, b requests of one adapter (prompt
  `--prompt-len`, exactly `--output-len` new tokens) submitted at once and run to completion,
  the fastest of `--repeats` runs after a warm-up (the run least disturbed by other processes on
  a shared machine); K and B are the least-squares line through (b, latency) (Fig. 12), the
  max batch the smallest b from which no larger size lowers latency / b by 5 % (Fig. 5,
  `fitting.plateau_batch`);
- load latency: LoRA, one synchronous copy of the adapter from host memory into its slot; ESFT,
  loading the adapter's rows; expert, reading one expert's rows from its safetensors file and
  writing them into a row (the disk tier);
- footprint: one LoRA slot's bytes over every site, one ESFT adapter's rows, one expert's rows;
  KV bytes per token from the engine's KV spec.

Usage probabilities come from `usage` (declared) and/or `sample` (adapter names of a sample of
requests: their shares, CoServe's "run the routing on a small sample"); with `budget_bytes` the
memory split (§4.4) is planned and stored. Adapters are made at random in a temporary directory
when `lora_dir` / `esft_dir` are not given. Timings on a shared machine are noisy: the profile
is a model, not a benchmark: every timing is the fastest of its repeats.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import torch

from elasticmoe.adapter_policy.fitting import linear_fit, plateau_batch
from elasticmoe.adapter_policy.memory_split import plan_memory_split
from elasticmoe.adapter_policy.profile import BASE_KIND, KindProfile, Profile, load_profile
from elasticmoe.adapter_policy.usage import check_probability
from elasticmoe.adapters.esft import EsftAdapter
from elasticmoe.adapters.lora import LoraAdapter
from elasticmoe.adapters.lora_targets import parse_target_modules
from elasticmoe.bench.common import ints, logger
from elasticmoe.config import EngineConfig, ModelConfig, parse_dtype
from elasticmoe.engine.llm_engine import LLMEngine
from elasticmoe.sampling_params import SamplingParams
from elasticmoe.tools.make_esft_adapter import make_esft_adapter
from elasticmoe.tools.make_lora_adapter import make_lora_adapter

__all__ = ["load_profile", "measure_profile", "write_profile"]

_log = logger("adapter_profile")
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
FIRST_ID = 3  # ids 0..2 are pad/bos/eos in our checkpoints


def write_profile(model_dir: str, out_path: str | Path, **options: Any) -> Profile:
    """Measure the profile of `model_dir` on this machine (`measure_profile(**options)`), write it to
    `out_path` as JSON and return it. The entry point of `elasticmoe profile`."""
    profile = measure_profile(model_dir, **options)
    profile.save(out_path)
    _log(f"wrote {out_path}")
    return profile


def measure_profile(
    model_dir: str,
    *,
    lora_dir: str | None = None,
    esft_dir: str | None = None,
    usage: Mapping[str, float] | None = None,
    sample: Sequence[str] | None = None,
    adapter_kinds: Mapping[str, str] | None = None,
    budget_bytes: int | None = None,
    batch_sizes: Sequence[int] = (1, 2, 4, 8, 16),
    prompt_len: int = 16,
    output_len: int = 4,
    repeats: int = 2,
    tokens_per_request: int | None = None,
    dtype: str = "float32",
    num_threads: int | None = None,
    seed: int = 0,
    lora_target_modules: tuple[str, ...] | None = None,
) -> Profile:
    """The profile of `model_dir` (see the module docstring). `usage` (adapter -> probability) wins
    over the shares in `sample`; `adapter_kinds` names the kind of each adapter there ("lora" if
    not given); `tokens_per_request` sizes one request's KV (default prompt + output);
    `lora_target_modules`: the modules the served LoRA slots will hold (`serve
    --lora-target-modules`; None: every module), which size a slot: the memory split carries them
    to `serve --profile`."""
    if not batch_sizes or min(batch_sizes) < 1 or min(prompt_len, output_len, repeats) < 1:
        raise ValueError("batch_sizes, prompt_len, output_len, repeats: must be >= 1")
    probabilities = _usage(usage, sample)
    kinds_of = {n: (adapter_kinds or {}).get(n, "lora") for n in probabilities}
    kinds_of.update(adapter_kinds or {})
    model_config = ModelConfig.from_pretrained(model_dir)
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="adapter-profile-") as tmp:
        lora_path = lora_dir or str(make_lora_adapter(model_dir, f"{tmp}/lora", rank=8,
                                                       target_modules=lora_target_modules or LORA_TARGETS,
                                                       seed=seed + 1))
        esft_path = esft_dir or str(make_esft_adapter(model_dir, f"{tmp}/esft", experts_per_layer=2, seed=seed + 2))
        lora = LoraAdapter.open("profile-lora", lora_path, model_config)
        esft = EsftAdapter.open("profile-esft", esft_path, model_config)
        engine = _engine(model_dir, lora, esft, max(batch_sizes), prompt_len + output_len, dtype, num_threads, seed,
                         lora_target_modules)
        points: dict[str, list[tuple[int, float]]] = {}
        kinds: dict[str, KindProfile] = {}
        for kind, adapter in ((BASE_KIND, None), ("lora", lora.name), ("esft", esft.name)):
            points[kind] = [(b, _batch_latency(engine, adapter, b, prompt_len, output_len, repeats, seed))
                            for b in batch_sizes]
            _log(f"{kind}: " + ", ".join(f"b={b} {t * 1e3:.1f} ms" for b, t in points[kind]))
        load_s, footprint = _loads(engine, lora, esft, repeats)
        for kind, kind_points in points.items():
            k, b = linear_fit([float(n) for n, _ in kind_points], [t for _, t in kind_points])
            kinds[kind] = KindProfile(plateau_batch(kind_points), max(0.0, k), max(0.0, b),
                                      load_s.get(kind, 0.0), footprint.get(kind, 0))
        # Offloaded experts run with the base model's batches: the base latency, their own load.
        kinds["expert"] = KindProfile(kinds[BASE_KIND].max_batch, 0.0, 0.0, load_s["expert"], footprint["expert"])
        kv_bytes_per_token = engine.kv_spec.bytes_per_block // engine.kv_spec.block_size
        esft.close()
    profile = Profile(
        model=str(model_dir), device="cpu", kinds=kinds, kv_bytes_per_token=kv_bytes_per_token,
        tokens_per_request=tokens_per_request or prompt_len + output_len, usage_probability=probabilities,
        adapter_kind=kinds_of,
        meta={"created_at": datetime.now(UTC).isoformat(timespec="seconds"), "torch_version": torch.__version__,
              "num_threads": torch.get_num_threads(), "dtype": dtype, "prompt_len": prompt_len,
              "output_len": output_len, "repeats": repeats, "sample_size": len(sample or ()),
              "points": {k: [[b, t] for b, t in v] for k, v in points.items()},
              "seconds": round(time.perf_counter() - started, 3)},
    )
    if budget_bytes is not None:
        split = dataclasses.replace(plan_memory_split(profile, budget_bytes), lora_target_modules=lora_target_modules)
        profile = dataclasses.replace(profile, memory_split=split)
    return profile


def _usage(usage: Mapping[str, float] | None, sample: Sequence[str] | None) -> dict[str, float]:
    out: dict[str, float] = {}
    if sample:
        for name in sample:
            out[name] = out.get(name, 0.0) + 1.0 / len(sample)
    for name, p in (usage or {}).items():
        out[name] = check_probability(p, f"usage_probability of {name!r}")
    return out


def _engine(model_dir: str, lora: LoraAdapter, esft: EsftAdapter, max_batch: int, tokens: int, dtype: str,
            num_threads: int | None, seed: int, lora_target_modules: tuple[str, ...] | None) -> LLMEngine:
    block_size = 16
    engine = LLMEngine(EngineConfig(
        model=model_dir, dtype=parse_dtype(dtype), num_threads=num_threads, seed=seed, block_size=block_size,
        enable_prefix_caching=False,  # the latency model times whole prefills of repeated prompts
        num_kv_blocks=max_batch * -(-tokens // block_size) + 4, max_num_seqs=max_batch,
        max_num_batched_tokens=max(2048, max_batch * tokens), max_loras=1, max_lora_rank=lora.config.r,
        lora_target_modules=lora_target_modules,
        max_esft_adapters=1, max_esft_experts=max(len(ids) for ids in esft.config.experts.values()),
    ))
    engine.adapters.load_lora(lora.name, lora.modules, lora.weights, lora.config.scaling)
    engine.adapters.load_esft(esft.name, esft.config.experts, esft.expert_weights)
    return engine


def _batch_latency(engine: LLMEngine, adapter: str | None, batch: int, prompt_len: int, output_len: int,
                   repeats: int, seed: int) -> float:
    """Seconds for `batch` requests of `adapter` submitted at once to finish (fastest of `repeats`)."""
    vocab = engine.model_config.vocab_size
    gen = torch.Generator().manual_seed(seed)
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    times = []
    for rep in range(repeats + 1):  # the first run warms up (allocations, caches) and is not counted
        prompts = torch.randint(FIRST_ID, vocab, (batch, prompt_len), generator=gen).tolist()
        t0 = time.perf_counter()
        for i, prompt in enumerate(prompts):
            engine.add_request(f"profile-{adapter}-{batch}-{rep}-{i}", prompt, params, adapter)
        while engine.has_unfinished_requests():
            engine.step()
        if rep:
            times.append(time.perf_counter() - t0)
    return min(times)


def _timed(fn: Callable[[], object], repeats: int) -> float:
    times = []
    for _ in range(repeats + 1):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times[1:])


def _loads(engine: LLMEngine, lora: LoraAdapter, esft: EsftAdapter, repeats: int) -> tuple[dict, dict]:
    """(kind -> load seconds, kind -> footprint bytes) of one LoRA slot, one ESFT adapter, one expert."""
    adapters = engine.adapters
    slots = adapters.lora
    assert slots is not None and adapters.esft is not None

    def swap_lora() -> None:
        slot = slots.evict(lora.name)
        slots.swap_in(lora.name, slot)

    def load_esft() -> None:
        adapters.discard(esft.name)
        adapters.load_esft(esft.name, esft.config.experts, esft.expert_weights)

    layer, experts = next(iter(sorted(esft.config.experts.items())))
    block = next(b for b in engine.model.moe_blocks() if b.prefix.split(".")[1] == str(layer))
    row13, row2 = torch.empty_like(block.w13[0]), torch.empty_like(block.w2[0])

    def load_expert() -> None:  # one expert from its file (mmap) into a row: the disk tier
        w13, w2 = esft.expert_weights(layer, experts[0], row13.dtype)
        row13.copy_(w13)
        row2.copy_(w2)

    load_s = {"lora": _timed(swap_lora, repeats), "esft": _timed(load_esft, repeats),
              "expert": _timed(load_expert, repeats)}
    footprint = {"lora": slots.slot_bytes, "esft": adapters.esft.nbytes_of[esft.name],
                 "expert": row13.nbytes + row2.nbytes}
    return load_s, footprint


def _target_modules(value: str) -> tuple[str, ...] | None:
    try:
        return parse_target_modules(value, "--lora-target-modules")
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from exc


def _parse_pairs(flag: str, items: Sequence[str], want: str) -> dict[str, str]:
    out = {}
    for item in items:
        name, sep, value = item.partition("=")
        if not sep or not name or not value:
            raise argparse.ArgumentTypeError(f"{flag}: want NAME={want}, got {item!r}")
        out[name] = value
    return out


def _parse_usage(items: Sequence[str]) -> dict[str, float]:
    out = {}
    for name, value in _parse_pairs("--usage", items, "P").items():
        try:
            out[name] = float(value)
        except ValueError:
            raise argparse.ArgumentTypeError(f"--usage: {name}={value!r} is not a probability") from None
    return out


def _parse_kinds(items: Sequence[str]) -> dict[str, str]:
    kinds = _parse_pairs("--kind", items, "lora|esft")
    if bad := sorted(n for n, k in kinds.items() if k not in ("lora", "esft")):
        raise argparse.ArgumentTypeError(f"--kind: {bad} want lora or esft")
    return kinds


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The profiler's options (this module's `main` and `elasticmoe profile`)."""
    p.add_argument("--model", required=True, help="base checkpoint directory")
    p.add_argument("--out", required=True, help="where to write the profile JSON")
    p.add_argument("--lora", default=None, help="a LoRA adapter directory to profile (default: a random rank-8 one)")
    p.add_argument("--esft", default=None, help="an ESFT adapter directory to profile (default: a random one)")
    p.add_argument("--usage", action="append", default=[], help="NAME=P: declared usage probability (repeatable)")
    p.add_argument("--kind", action="append", default=[],
                   help="NAME=lora|esft: an adapter's kind for the memory split (default lora; repeatable): ESFT "
                   "adapters take ESFT slots, LoRA adapters LoRA slots")
    p.add_argument("--sample", default=None, help="a file of adapter names, one per request of a sample")
    p.add_argument("--budget-gb", type=float, default=None, help="plan the memory split of this budget")
    p.add_argument("--batch-sizes", type=ints, default=[1, 2, 4, 8, 16])
    p.add_argument("--prompt-len", type=int, default=16)
    p.add_argument("--output-len", type=int, default=4)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    p.add_argument("--num-threads", type=int, default=None)
    p.add_argument("--lora-target-modules", type=_target_modules, default=None, metavar="NAMES",
                   help="the modules the served LoRA slots hold (serve --lora-target-modules; default: every module): "
                        "they size a slot, and `serve --profile` takes them from the memory split")


def run(args: argparse.Namespace) -> Profile:
    """Profile as `args` say, write the JSON and print it."""
    sample = Path(args.sample).read_text().split() if args.sample else None
    profile = write_profile(
        args.model, args.out, lora_dir=args.lora, esft_dir=args.esft, usage=_parse_usage(args.usage), sample=sample,
        adapter_kinds=_parse_kinds(args.kind),
        budget_bytes=int(args.budget_gb * (1 << 30)) if args.budget_gb is not None else None,
        batch_sizes=args.batch_sizes, prompt_len=args.prompt_len, output_len=args.output_len, repeats=args.repeats,
        dtype=args.dtype, num_threads=args.num_threads, lora_target_modules=args.lora_target_modules)
    print(json.dumps(profile.to_json(), indent=2))
    return profile


def main(argv: list[str] | None = None) -> Profile:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="\n".join(__doc__.splitlines()[2:]))
    add_arguments(p)
    return run(p.parse_args(argv))


if __name__ == "__main__":
    main(sys.argv[1:])
