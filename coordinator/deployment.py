"""The coordinator as a Serve application for a Ray cluster we did not start (KubeRay RayService).

`serveConfigV2` names `import_path: coordinator.deployment:app_builder` and passes
`args`: `CoordinatorConfig` fields by name (`model_dir`, `num_devices`, `dp`, ...),
sizes in bytes, plus an `autoscale` mapping of `AutoscaleConfig` fields. API keys
are never args (they would sit in the RayService object): they come from the
environment, `ELASTICMOE_API_KEY` and `ELASTICMOE_ADMIN_KEY`, set from a Secret.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

from coordinator.autoscaler import AutoscaleConfig
from coordinator.config import CoordinatorConfig
from coordinator.launch import coordinator_app
from elasticmoe.entrypoints.openai.access import AccessPolicy

API_KEY_ENV = "ELASTICMOE_API_KEY"
ADMIN_KEY_ENV = "ELASTICMOE_ADMIN_KEY"
_ACCESS_ARGS = ("max_body_bytes", "max_header_bytes")
_NOT_ARGS = {"access", "autoscale", "esft_adapters", "lora_adapters"}


def config_from_args(args: dict[str, Any], environ: dict[str, str] | None = None) -> CoordinatorConfig:
    """Raises `ValueError` naming the bad or unknown arg."""
    environ = dict(os.environ) if environ is None else environ
    args = dict(args)
    allowed = {f.name for f in dataclasses.fields(CoordinatorConfig)} - _NOT_ARGS
    allowed |= {"autoscale", "esft_adapters", "lora_adapters", *_ACCESS_ARGS}
    unknown = sorted(set(args) - allowed)
    if unknown:
        raise ValueError(f"serveConfigV2 args: unknown key(s) {', '.join(unknown)}; known: {', '.join(sorted(allowed))}")
    access = AccessPolicy(
        api_key=environ.get(API_KEY_ENV) or None,
        admin_key=environ.get(ADMIN_KEY_ENV) or None,
        **{k: int(args.pop(k)) for k in _ACCESS_ARGS if k in args},
    )
    autoscale = AutoscaleConfig.from_mapping(args.pop("autoscale", None) or {}, "serveConfigV2 args.autoscale")
    for key in ("esft_adapters", "lora_adapters"):  # name -> directory
        args[key] = tuple((str(name), str(path)) for name, path in (args.get(key) or {}).items())
    return CoordinatorConfig(**args, autoscale=autoscale, access=access)


def app_builder(args: dict[str, Any]) -> Any:
    """Serve's application builder (`import_path: coordinator.deployment:app_builder`)."""
    return coordinator_app(config_from_args(args))
