"""The `elasticmoe` command: the single composition root (may import upward, lazily)."""

from __future__ import annotations

import argparse
import logging
import os
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
    p.add_argument("--preset", default="tiny", choices=["tiny", "tiny-vllm", "small"],
                   help="tiny: for tests (loads in well under a second); tiny-vllm: tiny with head_dim 32 "
                   "(qwen3_moe only; what vLLM's CPU attention can run); small: the benchmark model")
    p.add_argument("--seed", type=int, default=0, help="RNG seed for weights and tokenizer corpus")
    p.add_argument("--out", required=True, help="output directory")


def _run_make_model(args: argparse.Namespace) -> int:
    from elasticmoe.tools.make_model import make_model

    out = make_model(args.arch, args.preset, args.seed, args.out)
    print(f"wrote {out}")
    return 0


def _add_make_esft_adapter(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "make-esft-adapter",
        help="write an ESFT adapter (tuned routed experts) for a base checkpoint",
        description="Write an adapter in the ESFT repository's format (expert_cfg.json + adapter_model.safetensors "
        "holding only the tuned experts, under the base checkpoint's tensor names). Tuned experts are the base "
        "experts plus seeded noise scaled by each tensor's std. Choose the experts with --config (e.g. a real ESFT "
        "expert_cfg.json) or --experts-per-layer (random distinct experts in every MoE layer).",
    )
    p.add_argument("--base", required=True, metavar="DIR", help="directory of the base HF checkpoint")
    p.add_argument("--out", required=True, metavar="DIR", help="adapter output directory")
    which = p.add_mutually_exclusive_group(required=True)
    which.add_argument("--config", metavar="FILE",
                       help="ESFT expert config JSON ({\"experts\": {\"<layer>\": [ids]}, ...}) naming the tuned experts")
    which.add_argument("--experts-per-layer", type=int, metavar="K",
                       help="tune K random distinct experts in every MoE layer")
    p.add_argument("--fit", action="store_true",
                   help="with --config: drop layers the base lacks or that are dense, fold expert ids modulo the "
                   "base's number of experts (to use a DeepSeek-V2-Lite config on a small model)")
    p.add_argument("--seed", type=int, default=0, help="RNG seed for the expert choice and the noise (default 0)")
    p.add_argument("--noise", type=float, default=0.05, metavar="X",
                   help="noise scale relative to each weight's std (default 0.05)")
    p.add_argument("--merged-out", default=None, metavar="DIR",
                   help="also write the merged model (base with the adapter's experts swapped in) here")


# AdapterError.param -> the option to blame
_ESFT_OPTIONS = {"experts_per_layer": "--experts-per-layer", "noise": "--noise", "out": "--out", "base": "--base",
                 "experts": "--config", "shared_experts": "--config", "non_expert_modules": "--config",
                 "config": "--config", "path": "--config"}


def _run_make_esft_adapter(args: argparse.Namespace) -> int:
    from elasticmoe.adapters.esft import EsftConfig
    from elasticmoe.errors import AdapterError
    from elasticmoe.tools.make_esft_adapter import make_esft_adapter, write_merged_model

    if args.fit and args.config is None:
        print("error: --fit: only applies with --config", file=sys.stderr)
        return 2
    try:
        config = EsftConfig.from_file(args.config) if args.config is not None else None
        out = make_esft_adapter(args.base, args.out, config=config, experts_per_layer=args.experts_per_layer,
                                seed=args.seed, noise=args.noise, fit=args.fit)
        print(f"wrote {out}")
        if args.merged_out is not None:
            merged = write_merged_model(args.base, out, args.merged_out)
            print(f"wrote {merged}")
    except AdapterError as exc:
        print(f"error: {_ESFT_OPTIONS.get(exc.param, '--' + exc.param)}: {exc}", file=sys.stderr)
        return 2
    return 0


def _add_make_lora_adapter(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "make-lora-adapter",
        help="write a PEFT-format LoRA adapter for a base checkpoint",
        description="Write a LoRA adapter in PEFT's format (adapter_config.json + adapter_model.safetensors with "
        "base_model.model.<module>.lora_A/lora_B.weight per adapted module). A and B are seeded Gaussians (B is "
        "not zero, so the adapter changes outputs) sized so that ||scaling*B@A|| is about a quarter of ||W||. "
        "Adaptable modules: attention projections (q_proj, k_proj, v_proj, o_proj; DeepSeek-V2: q_proj or "
        "q_a_proj/q_b_proj, kv_a_proj_with_mqa, o_proj; not kv_b_proj, which MLA absorbs) and routed-expert projections (gate_proj, "
        "up_proj, down_proj; Mixtral: w1, w3, w2).",
    )
    p.add_argument("--base", required=True, metavar="DIR", help="directory of the base HF checkpoint")
    p.add_argument("--out", required=True, metavar="DIR", help="adapter output directory")
    p.add_argument("--rank", type=int, default=8, metavar="R", help="LoRA rank r (default 8)")
    p.add_argument("--alpha", type=float, default=16.0, metavar="A", help="lora_alpha (default 16)")
    p.add_argument("--targets", default="q_proj,v_proj", metavar="NAMES",
                   help="comma-separated module names to adapt (default q_proj,v_proj)")
    p.add_argument("--layers", default=None, metavar="IDS",
                   help="comma-separated layer ids to adapt (default: all; expert targets only in MoE layers)")
    p.add_argument("--experts", default=None, metavar="IDS",
                   help="comma-separated routed expert ids for expert targets (default: all)")
    p.add_argument("--seed", type=int, default=0, help="RNG seed for A and B (default 0)")
    p.add_argument("--rslora", action="store_true", help="rank-stabilised scaling alpha/sqrt(r) instead of alpha/r")
    p.add_argument("--merged-out", default=None, metavar="DIR",
                   help="also write the merged model (W + scaling*B@A for every adapted module) here")


# AdapterError.param -> the option to blame
_LORA_OPTIONS = {"rank": "--rank", "r": "--rank", "alpha": "--alpha", "lora_alpha": "--alpha",
                 "target_modules": "--targets", "layers": "--layers", "experts": "--experts", "out": "--out",
                 "base": "--base", "use_rslora": "--rslora"}


def _int_list(text: str | None, option: str) -> list[int] | None:
    """`0,1,3` -> [0, 1, 3]; raises ValueError naming `option`."""
    if text is None:
        return None
    try:
        return [int(x) for x in text.split(",")]
    except ValueError:
        raise ValueError(f"{option}: want comma-separated integers, got {text!r}") from None


def _run_make_lora_adapter(args: argparse.Namespace) -> int:
    from elasticmoe.errors import AdapterError
    from elasticmoe.tools.make_lora_adapter import make_lora_adapter, write_lora_merged_model

    try:
        layers, experts = _int_list(args.layers, "--layers"), _int_list(args.experts, "--experts")
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    targets = [t.strip() for t in args.targets.split(",") if t.strip()]
    try:
        out = make_lora_adapter(args.base, args.out, rank=args.rank, alpha=args.alpha, target_modules=targets,
                                layers=layers, experts=experts, seed=args.seed, use_rslora=args.rslora)
        print(f"wrote {out}")
        if args.merged_out is not None:
            merged = write_lora_merged_model(args.base, out, args.merged_out)
            print(f"wrote {merged}")
    except AdapterError as exc:
        print(f"error: {_LORA_OPTIONS.get(exc.param, '--' + exc.param)}: {exc}", file=sys.stderr)
        return 2
    return 0


def _add_serve(sub: argparse._SubParsersAction) -> None:
    from coordinator.cli_options import add_elastic_arguments
    from elasticmoe.entrypoints.serve_settings import ServeSettings
    from elasticmoe.utils.settings import add_flags

    p = sub.add_parser(
        "serve",
        help="serve a model over an OpenAI-compatible HTTP API",
        description="Serve a model over an OpenAI-compatible HTTP API (/v1/completions, /v1/chat/completions, "
        "/v1/models, /health, /ready, /metrics). By default the elastic server: Ray Serve coordinator, HMM "
        "device memory on --devices logical devices, and an instance of --dp data-parallel ranks "
        "(expert-parallel size = dp), with /admin/status. --single runs one engine in this process instead. "
        "Every option below but --single, --host, --port, --address and --config is also a key of the "
        "--config file's [serve] table (the autoscaler's: of its [autoscale] table, without the prefix) and "
        "an arg of the RayService (docs/operations.md): its name with underscores, or the [key] its help "
        "names; sizes are bytes there.",
    )
    p.add_argument("--single", action="store_true",
                   help="run one engine in this process (no Ray, no elastic scaling)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1; 0.0.0.0 for all interfaces)")
    p.add_argument("--port", type=int, default=8000, help="TCP port to listen on (default 8000)")
    p.add_argument("--address", default=None, metavar="ADDR",
                   help="elastic server: join this Ray cluster (e.g. 10.0.0.1:6379 or auto) instead of starting a "
                   "local one")
    p.add_argument("--config", default=None, metavar="FILE",
                   help="TOML file whose [serve] and [autoscale] tables set any option by its name (e.g. "
                   "max_num_seqs = 64; [autoscale] min_dp = 1); flags win over the file")
    add_flags(p.add_argument_group("model, limits, adapters, access and shutdown (both servers)"), ServeSettings)
    add_elastic_arguments(p)


def _add_drain(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "drain",
        help="drain a running server (Kubernetes preStop)",
        description="Ask a running server to stop taking requests (503) and wait until those in flight have "
        "finished or the timeout passed (POST /admin/drain). Exit 0 when drained, 1 when requests were still in "
        "flight at the timeout, 2 when the server could not be asked. The admin key comes from "
        "$ELASTICMOE_ADMIN_KEY (else $ELASTICMOE_API_KEY).",
    )
    p.add_argument("--url", default="http://127.0.0.1:8000", help="server base URL (default http://127.0.0.1:8000)")
    p.add_argument("--timeout-s", type=float, default=30.0, metavar="S",
                   help="longest wait for requests in flight (default 30)")


def _admin_call(url: str, method: str, path: str, timeout_s: float) -> tuple[int, dict]:
    """(HTTP status, JSON body) of one admin call; the key comes from $ELASTICMOE_ADMIN_KEY (else
    $ELASTICMOE_API_KEY). `OSError` when the server cannot be reached."""
    import json
    import urllib.error
    import urllib.request

    key = os.environ.get("ELASTICMOE_ADMIN_KEY") or os.environ.get("ELASTICMOE_API_KEY")
    request = urllib.request.Request(f"{url.rstrip('/')}{path}", method=method,
                                     headers={"Authorization": f"Bearer {key}"} if key else {})
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        body = exc.read().decode(errors="replace")
        try:
            return exc.code, json.loads(body)
        except ValueError:
            return exc.code, {"error": {"message": body[:500]}}


def _run_drain(args: argparse.Namespace) -> int:
    import json

    try:
        status, result = _admin_call(args.url, "POST", f"/admin/drain?timeout_s={args.timeout_s:g}",
                                     args.timeout_s + 30)
    except OSError as exc:
        print(f"error: {args.url}: {exc}", file=sys.stderr)
        return 2
    if status >= 400:
        print(f"error: {args.url}: HTTP {status}: {json.dumps(result)[:500]}", file=sys.stderr)
        return 2
    print(json.dumps(result))
    return 0 if result.get("drained") else 1


def _add_drain_node(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "drain-node",
        help="move the model off one Ray node and give its devices back (a worker pod's preStop)",
        description="Ask a running elastic server to drain a node (POST /admin/nodes/{node}/drain: the model "
        "moves to the other nodes' devices by a zero-downtime switchover, then the node's devices are "
        "unregistered and freed) and wait until the node may be removed. Exit 0 when it may (or when the server "
        "has no device there), 1 when the drain failed or did not finish in time (e.g. the node holds the last "
        "devices), 2 when the server could not be asked. The admin key comes from $ELASTICMOE_ADMIN_KEY (else "
        "$ELASTICMOE_API_KEY).",
    )
    p.add_argument("--url", default="http://127.0.0.1:8000", help="server base URL (default http://127.0.0.1:8000)")
    p.add_argument("--node", required=True, help="the node: its Ray node id (or a unique prefix of 6+ characters), "
                   "or its address (a pod's IP: $(hostname -i))")
    p.add_argument("--timeout-s", type=float, default=120.0, metavar="S",
                   help="longest wait for the node to become removable (default 120)")


def _run_drain_node(args: argparse.Namespace) -> int:
    import json
    import time
    import urllib.parse

    node = urllib.parse.quote(args.node, safe="")
    deadline = time.monotonic() + args.timeout_s
    try:
        status, result = _admin_call(args.url, "POST", f"/admin/nodes/{node}/drain", 30)
        if status == 404:
            print(json.dumps({"node": args.node, "state": "not used by this server"}))
            return 0
        if status >= 400 and not (status == 409 and "drained" in json.dumps(result)):
            print(f"error: drain of {args.node}: HTTP {status}: {json.dumps(result)[:500]}", file=sys.stderr)
            return 1 if status == 409 else 2
        while True:
            status, result = _admin_call(args.url, "GET", f"/admin/nodes/{node}", 30)
            if status >= 400:
                print(f"error: node {args.node}: HTTP {status}: {json.dumps(result)[:500]}", file=sys.stderr)
                return 2
            if result.get("removable") or result.get("state") != "draining" or time.monotonic() >= deadline:
                break
            time.sleep(0.5)
    except OSError as exc:
        print(f"error: {args.url}: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(result))
    return 0 if result.get("removable") else 1


def _add_profile(sub: argparse._SubParsersAction) -> None:
    from elasticmoe.bench.adapter_profile import add_arguments

    p = sub.add_parser(
        "profile",
        help="profile adapters on this machine for `serve --profile` (CoServe §4.4)",
        description="Measure, on a real engine over the checkpoint, the latency model (K*n + B per adapter kind), "
        "the largest useful batch, the adapter load latencies and footprints, and (with --budget-gb) the memory "
        "split between KV cache, adapter slots and experts found by the decay-window search; write them as JSON "
        "for `elasticmoe serve --profile FILE` (eviction and assignment read the usage probabilities, the "
        "engines the memory split).",
    )
    add_arguments(p)


def _run_profile(args: argparse.Namespace) -> int:
    from elasticmoe.bench.adapter_profile import run

    run(args)
    return 0


def _add_reap_shm(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "reap-shm",
        help="free shared memory that dead servers left on this node",
        description="Unlink this node's /dev/shm files of the HMM whose owner process is gone (a server or "
        "device worker killed with SIGKILL before it could free them). Files of running servers are never "
        "touched: each owner holds a lock on its lease file for as long as it lives. Prints the files freed.",
    )
    which = p.add_mutually_exclusive_group()
    which.add_argument("--prefix", default=None, metavar="PREFIX",
                       help="the servers' --shm-prefix (default: emoe, the servers' default)")
    which.add_argument("--all", action="store_true",
                       help="every prefix found in /dev/shm (servers with their own --shm-prefix, killed test runs)")
    p.add_argument("--dry-run", action="store_true", help="only print what would be freed")


def _run_reap_shm(args: argparse.Namespace) -> int:
    from hmm.memory.lease import reap, reap_all
    from hmm.memory.segments import DEFAULT_PREFIX

    names = reap_all(args.dry_run) if args.all else reap(args.prefix or DEFAULT_PREFIX, dry_run=args.dry_run)
    for name in names:
        print(name)
    print(f"{'would free' if args.dry_run else 'freed'} {len(names)} files", file=sys.stderr)
    return 0


def _run_serve(args: argparse.Namespace) -> int:
    from coordinator.cli_options import elastic_config

    if args.single:
        return _run_serve_single(args)
    try:  # validate before Ray starts: bad values exit 2 with the option named
        config = elastic_config(args)
    except ValueError as exc:
        print(f"error: {exc} (elastic server; --single runs one engine in this process)", file=sys.stderr)
        return 2
    _warn_if_open(args.host, config.api_key)
    from coordinator.launch import serve_elastic

    return serve_elastic(config, host=args.host, port=args.port, address=args.address)


def _run_serve_single(args: argparse.Namespace) -> int:
    from coordinator.autoscaler import AutoscaleConfig
    from coordinator.cli_options import TABLES
    from coordinator.config import CoordinatorConfig
    from elasticmoe.entrypoints.serve_settings import ServeSettings
    from elasticmoe.utils.settings import flag_name, flag_values, from_sources

    elastic_only = set(flag_values(args, CoordinatorConfig)) - set(ServeSettings.model_fields)
    given = sorted([flag_name(CoordinatorConfig, name) for name in elastic_only]
                   + [flag_name(AutoscaleConfig, name, "autoscale-") for name in flag_values(args, AutoscaleConfig,
                                                                                            "autoscale-")])
    if given or args.address:
        print(f"error: {', '.join(given or ['--address'])}: needs the elastic server (drop --single)", file=sys.stderr)
        return 2
    try:
        settings: ServeSettings = from_sources(ServeSettings, args, args.config, "serve", tables=TABLES)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    _warn_if_open(args.host, settings.api_key)
    from elasticmoe.entrypoints.openai.api_server import run_single_server

    return run_single_server(settings, host=args.host, port=args.port, log_level=args.log_level.lower())


def _warn_if_open(host: str, api_key: object) -> None:
    if api_key is None and host not in ("127.0.0.1", "localhost", "::1"):
        logging.getLogger(__name__).warning("serving on %s without --api-key: anyone who reaches it may use it", host)


# command -> (adds its parser, runs it)
_COMMANDS = {"make-model": (_add_make_model, _run_make_model),
             "make-esft-adapter": (_add_make_esft_adapter, _run_make_esft_adapter),
             "make-lora-adapter": (_add_make_lora_adapter, _run_make_lora_adapter),
             "serve": (_add_serve, _run_serve), "drain": (_add_drain, _run_drain),
             "drain-node": (_add_drain_node, _run_drain_node), "profile": (_add_profile, _run_profile),
             "reap-shm": (_add_reap_shm, _run_reap_shm)}


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The CLI's parser; with `command`, that subcommand's options only. Some subcommands' options
    come from the serving configs (pydantic models, ~0.5 s to import; no torch, no Ray):
    `drain-node` runs in a pod's preStop hook, on a node that is still serving, and should not pay
    for `serve`'s."""
    parser = argparse.ArgumentParser(prog="elasticmoe", description="Elastic serving of MoE LLMs.")
    parser.add_argument("--log-level", default="INFO", help="logging level (default INFO)")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, (add, _) in _COMMANDS.items():
        if command is None or name == command:
            add(sub)
    return parser


def _command_in(argv: list[str]) -> str | None:
    """The subcommand `argv` names (its first word that is one and not `--log-level`'s value); None
    when there is none (then the whole parser answers: usage, or --help listing every command)."""
    for i, word in enumerate(argv):
        if word in _COMMANDS and (i == 0 or argv[i - 1] != "--log-level"):
            return word
    return None


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser(_command_in(argv)).parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return _COMMANDS[args.command][1](args)


if __name__ == "__main__":
    sys.exit(main())
