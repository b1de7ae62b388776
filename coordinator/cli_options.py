"""`elasticmoe serve` options of the autoscaler: flags and the `[autoscale]` section of `--config`.

Every `AutoscaleConfig` field is both a flag `--autoscale-<field>` and a key of the
config file's `[autoscale]` table (TOML); a flag given on the command line wins
over the file, the file over the defaults. `--autoscale` alone turns it on.
"""

from __future__ import annotations

import argparse
import dataclasses
import tomllib
from pathlib import Path
from typing import Any

from coordinator.autoscaler import AutoscaleConfig
from coordinator.strategies import STRATEGIES

_HELP = {
    "min_dp": "smallest dp the autoscaler scales down to (default 1)",
    "max_dp": "largest dp it scales up to (default: every device)",
    "slo_ttft_s": "SLO target for time to first token, seconds (default 1.0; also on /metrics when off)",
    "slo_tpot_s": "SLO target for time per output token after the first, seconds (default 0.5)",
    "target_attainment": "scale up when SLO attainment stays below this fraction (default 0.9, the paper's)",
    "scale_down_attainment": "scale down only while attainment is at least this (default 0.99; the band "
    "between the two is hysteresis)",
    "window_s": "sliding window of the SLO estimator, seconds (default 20)",
    "interval_s": "seconds between decisions (default 1)",
    "scale_up_after_s": "a violation must persist this long before scaling up (default 5)",
    "scale_down_after_s": "over-provisioning must persist this long before scaling down (default 30)",
    "cooldown_s": "no decision for this long after any scale finishes (default 30)",
    "min_samples": "finished requests the window needs before attainment counts (default 10)",
    "scale_down_headroom": "scale down only if the load per rank at dp-1 stays under this fraction of a "
    "rank's capacity (or p90 latencies under this fraction of the targets while the capacity is unknown; "
    "default 0.7)",
    "rank_capacity_rps": "requests/s one rank sustains within the SLO, if known (default: learned when "
    "the SLO is first violated)",
    "strategy": f"how the autoscaler scales: one of {', '.join(STRATEGIES)} (default elastic)",
}


def add_autoscale_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group(
        "autoscaling (elastic server): scale dp by one when SLO attainment says so (ElasticMoE §4.3); "
        "a manual POST /admin/scale pauses it until POST /admin/autoscaler {\"enabled\": true}"
    )
    group.add_argument("--autoscale", action="store_true", default=None, help="turn the autoscaler on")
    group.add_argument("--config", default=None, metavar="FILE",
                       help="TOML file whose [autoscale] table sets any of the options below by their names "
                       "without the prefix (e.g. min_dp = 1); flags win over the file")
    for field in dataclasses.fields(AutoscaleConfig):
        if field.name == "enabled":
            continue
        kind: Any = {"int": int, "float": float, "str": str}[_base_type(field.type)]
        group.add_argument(f"--autoscale-{field.name.replace('_', '-')}", dest=f"autoscale_{field.name}",
                           type=kind, default=None, metavar=field.name.split("_")[-1].upper(),
                           help=_HELP[field.name])


def _base_type(annotation: Any) -> str:
    text = str(annotation)
    return next(t for t in ("int", "float", "str") if t in text)


def autoscale_config(args: argparse.Namespace) -> AutoscaleConfig:
    """The merged configuration. Raises `ValueError` naming the option, file or key."""
    values: dict[str, Any] = {}
    if args.config is not None:
        values.update(_read_section(Path(args.config)))
    if args.autoscale:
        values["enabled"] = True
    for field in dataclasses.fields(AutoscaleConfig):
        given = getattr(args, f"autoscale_{field.name}", None)
        if given is not None:
            values[field.name] = given
    return AutoscaleConfig.from_mapping(values, f"--config {args.config} [autoscale]" if args.config else "--autoscale")


def _read_section(path: Path) -> dict[str, Any]:
    try:
        document = tomllib.loads(path.read_text())
    except OSError as exc:
        raise ValueError(f"--config: cannot read {path}: {exc.strerror}") from exc
    except tomllib.TOMLDecodeError as exc:
        raise ValueError(f"--config: {path} is not valid TOML: {exc}") from exc
    unknown = sorted(set(document) - {"autoscale"})
    if unknown:
        raise ValueError(f"--config: {path}: unknown table(s) {', '.join(unknown)}; known: autoscale")
    section = document.get("autoscale", {})
    if not isinstance(section, dict):
        raise ValueError(f"--config: {path}: [autoscale] must be a table")
    return section
