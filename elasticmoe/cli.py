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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="elasticmoe", description="Elastic serving of MoE LLMs.")
    parser.add_argument("--log-level", default="INFO", help="logging level (default INFO)")
    sub = parser.add_subparsers(dest="command", required=True)
    _add_make_model(sub)
    return parser


_COMMANDS = {"make-model": _run_make_model}


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return _COMMANDS[args.command](args)


if __name__ == "__main__":
    sys.exit(main())
