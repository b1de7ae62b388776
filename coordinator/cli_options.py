"""`elasticmoe serve`'s elastic-server options: flags and the tables of `--config`, derived from
`CoordinatorConfig` and `AutoscaleConfig` (`elasticmoe.utils.settings`).

Every field is a flag (`--autoscale-<field>` for the autoscaler's) and a key of the
config file's `[serve]` (or `[autoscale]`) table (TOML); a flag given on the command
line wins over the file, the file over the defaults. `--autoscale` alone turns the
autoscaler on.
"""

from __future__ import annotations

import argparse

from coordinator.autoscaler import AutoscaleConfig
from coordinator.config import CoordinatorConfig
from elasticmoe.entrypoints.serve_settings import ServeSettings
from elasticmoe.utils.settings import add_flags, from_sources

TABLES = {"serve", "autoscale"}


def add_elastic_arguments(parser: argparse.ArgumentParser) -> None:
    add_flags(parser.add_argument_group("elastic server (without --single)"), CoordinatorConfig,
              skip=frozenset(ServeSettings.model_fields))
    add_flags(parser.add_argument_group(
        "autoscaling (elastic server): scale dp by one when SLO attainment says so (ElasticMoE §4.3); "
        "a manual POST /admin/scale pauses it until POST /admin/autoscaler {\"enabled\": true}"
    ), AutoscaleConfig, prefix="autoscale-")


def elastic_config(args: argparse.Namespace) -> CoordinatorConfig:
    """The merged configuration. Raises `ValueError` naming the flag, or file and key."""
    config: CoordinatorConfig = from_sources(CoordinatorConfig, args, args.config, "serve",
                                             sections={"autoscale": "autoscale-"})
    return config


def autoscale_config(args: argparse.Namespace) -> AutoscaleConfig:
    """The autoscaler's part alone (flags over the `[autoscale]` table over the defaults)."""
    config: AutoscaleConfig = from_sources(AutoscaleConfig, args, args.config, "autoscale", prefix="autoscale-",
                                           tables=TABLES)
    return config
