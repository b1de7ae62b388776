"""The `elasticmoe` command: the single composition root (may import upward, lazily)."""

from __future__ import annotations

import argparse
import logging
import sys


def _add_make_model(sub: argparse._SubParsersAction) -> None:
    from elasticmoe.tools.make_model import PRESETS

    p = sub.add_parser(
        "make-model",
        help="write a random HF-format MoE checkpoint of a real architecture",
        description="Build a randomly initialised checkpoint with transformers' own classes "
        "(config.json, model.safetensors, generation_config.json, tokenizer with chat template).",
    )
    p.add_argument("--arch", required=True, choices=sorted(PRESETS), help="model family")
    p.add_argument("--preset", default="tiny", choices=["tiny", "small"],
                   help="tiny: for tests (loads in well under a second); small: the benchmark model")
    p.add_argument("--seed", type=int, default=0, help="RNG seed for weights and tokenizer corpus")
    p.add_argument("--out", required=True, help="output directory")


def _run_make_model(args: argparse.Namespace) -> int:
    from elasticmoe.tools.make_model import make_model

    out = make_model(args.arch, args.preset, args.seed, args.out)
    print(f"wrote {out}")
    return 0


def _add_serve(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "serve",
        help="serve a model over an OpenAI-compatible HTTP API",
        description="Serve a model over an OpenAI-compatible HTTP API (/v1/completions, /v1/chat/completions, "
        "/v1/models, /health, /ready, /metrics). Only the single-process server (--single) exists so far.",
    )
    p.add_argument("--single", action="store_true",
                   help="run one engine in this process (no Ray, no elastic scaling); currently required")
    p.add_argument("--model", required=True, metavar="DIR", help="directory of an HF checkpoint (config.json, safetensors, tokenizer)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1; 0.0.0.0 for all interfaces)")
    p.add_argument("--port", type=int, default=8000, help="TCP port to listen on (default 8000)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                   help="weight and activation dtype (default float32, the fast choice on most CPUs)")
    p.add_argument("--served-model-name", default=None, metavar="NAME",
                   help="model name clients pass as `model` (default: the model directory's name)")
    p.add_argument("--max-model-len", type=int, default=None, metavar="N",
                   help="context length limit, prompt plus output tokens (default: the model's maximum)")
    p.add_argument("--kv-cache-gb", type=float, default=None, metavar="GB",
                   help="memory for the paged KV cache in GiB (default: the engine's default, 1 GiB)")
    p.add_argument("--max-num-batched-tokens", type=int, default=None, metavar="N",
                   help="token budget of one engine step across all requests (default: the engine's default)")


def _run_serve(args: argparse.Namespace) -> int:
    if not args.single:
        print("error: only the single-process server exists yet; pass --single. "
              "The elastic (Ray) server arrives with a later issue.", file=sys.stderr)
        return 2
    from elasticmoe.entrypoints.openai.api_server import run_single_server

    return run_single_server(
        model_dir=args.model,
        host=args.host,
        port=args.port,
        dtype=args.dtype,
        served_model_name=args.served_model_name,
        max_model_len=args.max_model_len,
        kv_cache_gb=args.kv_cache_gb,
        max_num_batched_tokens=args.max_num_batched_tokens,
        log_level=args.log_level.lower(),
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="elasticmoe", description="Elastic serving of MoE LLMs.")
    parser.add_argument("--log-level", default="INFO", help="logging level (default INFO)")
    sub = parser.add_subparsers(dest="command", required=True)
    _add_make_model(sub)
    _add_serve(sub)
    return parser


_COMMANDS = {"make-model": _run_make_model, "serve": _run_serve}


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return _COMMANDS[args.command](args)


if __name__ == "__main__":
    sys.exit(main())
