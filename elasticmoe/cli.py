"""The `elasticmoe` command: the single composition root (may import upward, lazily)."""

from __future__ import annotations

import argparse
import logging
import os
import sys

from elasticmoe.entrypoints.openai.access import (
    DEFAULT_MAX_BODY_BYTES,
    DEFAULT_MAX_HEADER_BYTES,
    AccessPolicy,
)


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
    from elasticmoe.adapters.esft import AdapterError, EsftConfig
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
    from elasticmoe.adapters.esft import AdapterError
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
    p = sub.add_parser(
        "serve",
        help="serve a model over an OpenAI-compatible HTTP API",
        description="Serve a model over an OpenAI-compatible HTTP API (/v1/completions, /v1/chat/completions, "
        "/v1/models, /health, /ready, /metrics). By default the elastic server: Ray Serve coordinator, HMM "
        "device memory on --devices logical devices, and an instance of --dp data-parallel ranks "
        "(expert-parallel size = dp), with /admin/status. --single runs one engine in this process instead.",
    )
    p.add_argument("--single", action="store_true",
                   help="run one engine in this process (no Ray, no elastic scaling)")
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
                   help="memory for the paged KV cache in GiB; elastic server: per device (default: 1 GiB single, "
                   "min(0.25, device memory / 4) elastic)")
    p.add_argument("--max-num-batched-tokens", type=int, default=None, metavar="N",
                   help="token budget of one engine step across all requests (default: the engine's default)")
    p.add_argument("--max-num-seqs", type=int, default=None, metavar="N",
                   help="requests one engine (one rank) runs at once; more wait in its queue (default 256)")
    esft = p.add_argument_group("ESFT adapters (expert-specialised fine-tunes over the base model)")
    esft.add_argument("--esft-adapter", action="append", default=[], metavar="NAME=DIR",
                      help="load an ESFT adapter (expert_cfg.json + safetensors) at start; clients select it with "
                      "model=NAME. Repeatable; more can be loaded at run time with POST /admin/adapters")
    esft.add_argument("--max-esft-adapters", type=int, default=4, metavar="N",
                      help="adapter slots (default 4; 0 disables adapters). Slots cost address space, not "
                      "memory: physical memory is used only by the experts an adapter tunes")
    esft.add_argument("--max-esft-experts", type=int, default=16, metavar="E",
                      help="most experts one adapter may tune in one layer (E_max, default 16)")
    lora = p.add_argument_group("LoRA adapters (PEFT format; attention and expert projections)")
    lora.add_argument("--lora-adapter", action="append", default=[], metavar="NAME=DIR",
                      help="load a LoRA adapter (adapter_config.json + adapter_model.safetensors) at start; "
                      "clients select it with model=NAME. Repeatable; POST /admin/adapters with type=lora "
                      "loads more at run time")
    lora.add_argument("--max-loras", type=int, default=0, metavar="S",
                      help="LoRA slots, allocated at start with fixed addresses (default 0: LoRA off)")
    lora.add_argument("--max-lora-rank", type=int, default=16, metavar="R",
                      help="largest LoRA rank a slot holds (default 16)")
    lora.add_argument("--max-cpu-loras", type=int, default=None, metavar="C",
                      help="LoRA adapters kept loaded in host memory, >= --max-loras (default: --max-loras); "
                      "beyond the slots they are swapped in when a request needs them")
    elastic = p.add_argument_group("elastic server (without --single)")
    elastic.add_argument("--devices", type=int, default=1, metavar="N",
                         help="logical devices to create: one HMM worker process and memory budget each (default 1)")
    elastic.add_argument("--dp", type=int, default=1, metavar="D",
                         help="data-parallel ranks of the first instance, 1 <= D <= --devices; expert parallelism "
                         "spans the same D ranks (default 1)")
    elastic.add_argument("--address", default=None, metavar="ADDR",
                         help="join this Ray cluster (e.g. 10.0.0.1:6379 or auto) instead of starting a local one")
    elastic.add_argument("--max-queued", type=int, default=256, metavar="N",
                         help="requests waiting plus in flight; beyond N the server answers 503 with Retry-After "
                         "(default 256)")
    elastic.add_argument("--device-memory-gb", type=float, default=4.0, metavar="G",
                         help="memory budget of each logical device in GiB: weights, KV cache and scaling "
                         "headroom (default 4)")
    elastic.add_argument("--no-standby-pool", action="store_true",
                         help="do not pre-initialise standby instances for dp-1 and dp+1 (saves their processes' "
                         "memory; each scale then boots its target instance, ~2 s slower)")
    elastic.add_argument("--standby-delay", type=float, default=0.0, metavar="S",
                         help="wait S seconds after a scale before booting the next standby instances (on CPU a "
                         "boot takes cores from serving; default 0: at once)")
    elastic.add_argument("--shm-prefix", default=None, metavar="PREFIX",
                         help="name prefix of the HMM's /dev/shm files (default elasticmoe-hmm); give each server "
                         "on one machine its own")
    ops = p.add_argument_group("access and shutdown (both servers)")
    ops.add_argument("--api-key", default=os.environ.get("ELASTICMOE_API_KEY") or None, metavar="KEY",
                     help="require 'Authorization: Bearer KEY' on /v1/* (default: $ELASTICMOE_API_KEY; prefer the "
                     "variable: a flag shows in the process list); /health, /ready, /metrics stay open")
    ops.add_argument("--admin-key", default=os.environ.get("ELASTICMOE_ADMIN_KEY") or None, metavar="KEY",
                     help="require this key on /admin/* (default: $ELASTICMOE_ADMIN_KEY, else the API key)")
    ops.add_argument("--max-body-bytes", type=int, default=DEFAULT_MAX_BODY_BYTES, metavar="N",
                     help=f"larger request bodies get 413 (default {DEFAULT_MAX_BODY_BYTES})")
    ops.add_argument("--max-header-bytes", type=int, default=DEFAULT_MAX_HEADER_BYTES, metavar="N",
                     help=f"larger request headers get 431 (default {DEFAULT_MAX_HEADER_BYTES})")
    ops.add_argument("--shutdown-timeout", type=float, default=30.0, metavar="S",
                     help="on SIGTERM/SIGINT (or POST /admin/drain) new requests get 503 and those in flight get up "
                     "to S seconds to finish before the server stops (default 30)")
    from coordinator.cli_options import add_autoscale_arguments

    add_autoscale_arguments(p)


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


def _run_drain(args: argparse.Namespace) -> int:
    import json
    import urllib.error
    import urllib.request

    key = os.environ.get("ELASTICMOE_ADMIN_KEY") or os.environ.get("ELASTICMOE_API_KEY")
    request = urllib.request.Request(f"{args.url.rstrip('/')}/admin/drain?timeout_s={args.timeout_s:g}",
                                     method="POST", headers={"Authorization": f"Bearer {key}"} if key else {})
    try:
        with urllib.request.urlopen(request, timeout=args.timeout_s + 30) as response:
            result = json.loads(response.read())
    except urllib.error.HTTPError as exc:
        print(f"error: {args.url}: HTTP {exc.code}: {exc.read().decode(errors='replace')[:500]}", file=sys.stderr)
        return 2
    except (urllib.error.URLError, OSError) as exc:
        print(f"error: {args.url}: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(result))
    return 0 if result.get("drained") else 1


def _add_reap_shm(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "reap-shm",
        help="free shared memory that dead servers left on this node",
        description="Unlink this node's /dev/shm files of the HMM whose owner process is gone (a server or "
        "device worker killed with SIGKILL before it could free them). Files of running servers are never "
        "touched: each owner holds a lock on its lease file for as long as it lives. Prints the files freed.",
    )
    p.add_argument("--prefix", default=None, metavar="PREFIX",
                   help="the servers' --shm-prefix (default: emoe, the servers' default)")
    p.add_argument("--dry-run", action="store_true", help="only print what would be freed")


def _run_reap_shm(args: argparse.Namespace) -> int:
    from hmm.memory.lease import reap
    from hmm.memory.shm import DEFAULT_PREFIX

    names = reap(args.prefix or DEFAULT_PREFIX, dry_run=args.dry_run)
    for name in names:
        print(name)
    print(f"{'would free' if args.dry_run else 'freed'} {len(names)} files", file=sys.stderr)
    return 0


def _named_dirs(items: list[str], option: str) -> dict[str, str] | None:
    """NAME=DIR options as a dict; None (after printing why) if one is malformed."""
    out: dict[str, str] = {}
    for item in items:
        name, sep, path = item.partition("=")
        if not sep or not name or not path:
            print(f"error: {option}: want NAME=DIR, got {item!r}", file=sys.stderr)
            return None
        if name in out:
            print(f"error: {option}: {name!r} given twice", file=sys.stderr)
            return None
        out[name] = path
    return out


def _adapter_args(args: argparse.Namespace) -> tuple[dict[str, str], dict[str, str]] | None:
    """(ESFT, LoRA) adapters to load at start; None (after printing why) if the options are bad."""
    esft = _named_dirs(args.esft_adapter, "--esft-adapter")
    lora = _named_dirs(args.lora_adapter, "--lora-adapter")
    if esft is None or lora is None:
        return None
    if set(esft) & set(lora):
        print(f"error: --lora-adapter: names {sorted(set(esft) & set(lora))} are ESFT adapters too", file=sys.stderr)
        return None
    if args.max_esft_adapters < 0 or args.max_esft_experts < 1:
        print("error: --max-esft-adapters must be >= 0 and --max-esft-experts >= 1", file=sys.stderr)
        return None
    if args.max_loras < 0 or args.max_lora_rank < 1:
        print("error: --max-loras must be >= 0 and --max-lora-rank >= 1", file=sys.stderr)
        return None
    if esft and args.max_esft_adapters < len(esft):
        print(f"error: --max-esft-adapters: {args.max_esft_adapters} slots for {len(esft)} --esft-adapter",
              file=sys.stderr)
        return None
    if args.max_cpu_loras is not None and args.max_cpu_loras < args.max_loras:
        print("error: --max-cpu-loras: must be >= --max-loras", file=sys.stderr)
        return None
    cached = args.max_cpu_loras if args.max_cpu_loras is not None else args.max_loras
    if lora and cached < len(lora):
        print(f"error: --max-cpu-loras: {cached} adapters fit for {len(lora)} --lora-adapter", file=sys.stderr)
        return None
    if lora and args.max_loras < 1:
        print(f"error: --max-loras: {args.max_loras} slots for {len(lora)} --lora-adapter", file=sys.stderr)
        return None
    return esft, lora


def _access_policy(args: argparse.Namespace) -> AccessPolicy | None:
    try:
        return AccessPolicy(api_key=args.api_key, admin_key=args.admin_key, max_body_bytes=args.max_body_bytes,
                            max_header_bytes=args.max_header_bytes)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return None


def _run_serve(args: argparse.Namespace) -> int:
    adapters = _adapter_args(args)
    access = _access_policy(args)
    if adapters is None or access is None:
        return 2
    if not 0 <= args.shutdown_timeout <= 3600:
        print(f"error: --shutdown-timeout: must be between 0 and 3600 s, got {args.shutdown_timeout:g}",
              file=sys.stderr)
        return 2
    if access.api_key is None and args.host not in ("127.0.0.1", "localhost", "::1"):
        logging.getLogger(__name__).warning("serving on %s without --api-key: anyone who reaches it may use it",
                                            args.host)
    esft_adapters, lora_adapters = adapters
    if not args.single:
        return _run_serve_elastic(args, esft_adapters, lora_adapters, access)
    if args.autoscale or args.config:
        print("error: --autoscale/--config: the autoscaler needs the elastic server (drop --single)", file=sys.stderr)
        return 2
    if not os.path.isfile(os.path.join(args.model, "config.json")):
        print(f"error: --model: {args.model} has no config.json (make one with `elasticmoe make-model`)",
              file=sys.stderr)
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
        max_num_seqs=args.max_num_seqs,
        log_level=args.log_level.lower(),
        max_esft_adapters=args.max_esft_adapters,
        max_esft_experts=args.max_esft_experts if args.max_esft_adapters else 0,
        esft_adapters=esft_adapters,
        max_loras=args.max_loras,
        max_lora_rank=args.max_lora_rank,
        max_cpu_loras=args.max_cpu_loras,
        lora_adapters=lora_adapters,
        access=access,
        shutdown_timeout_s=args.shutdown_timeout,
    )


def _run_serve_elastic(
    args: argparse.Namespace, esft_adapters: dict[str, str], lora_adapters: dict[str, str], access: AccessPolicy
) -> int:
    from coordinator.cli_options import autoscale_config
    from coordinator.config import CoordinatorConfig
    from coordinator.launch import serve_elastic

    kv_cache_gb = args.kv_cache_gb if args.kv_cache_gb is not None else min(0.25, args.device_memory_gb / 4)
    try:  # validate before Ray starts: bad values exit 2 with the option named
        config = CoordinatorConfig(
            model_dir=args.model, num_devices=args.devices, dp=args.dp, dtype=args.dtype,
            device_memory_bytes=int(args.device_memory_gb * (1 << 30)),
            kv_bytes_per_device=int(kv_cache_gb * (1 << 30)), max_queued=args.max_queued,
            served_model_name=args.served_model_name, standby_pool=not args.no_standby_pool,
            max_model_len=args.max_model_len, max_num_batched_tokens=args.max_num_batched_tokens,
            max_num_seqs=args.max_num_seqs, standby_delay_s=args.standby_delay,
            max_esft_adapters=args.max_esft_adapters, max_esft_experts=args.max_esft_experts,
            esft_adapters=tuple(esft_adapters.items()),
            max_loras=args.max_loras, max_lora_rank=args.max_lora_rank,
            lora_adapters=tuple(lora_adapters.items()),
            autoscale=autoscale_config(args), access=access, shutdown_timeout_s=args.shutdown_timeout,
            **({"shm_prefix": args.shm_prefix} if args.shm_prefix else {}),
        )
    except ValueError as exc:
        print(f"error: {exc} (elastic server; --single runs one engine in this process)", file=sys.stderr)
        return 2
    return serve_elastic(config, host=args.host, port=args.port, address=args.address)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="elasticmoe", description="Elastic serving of MoE LLMs.")
    parser.add_argument("--log-level", default="INFO", help="logging level (default INFO)")
    sub = parser.add_subparsers(dest="command", required=True)
    _add_make_model(sub)
    _add_make_esft_adapter(sub)
    _add_make_lora_adapter(sub)
    _add_serve(sub)
    _add_drain(sub)
    _add_reap_shm(sub)
    return parser


_COMMANDS = {"make-model": _run_make_model, "make-esft-adapter": _run_make_esft_adapter,
             "make-lora-adapter": _run_make_lora_adapter, "serve": _run_serve,
             "drain": _run_drain, "reap-shm": _run_reap_shm}


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return _COMMANDS[args.command](args)


if __name__ == "__main__":
    sys.exit(main())
