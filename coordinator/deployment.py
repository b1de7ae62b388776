"""The coordinator as a Serve application for a Ray cluster we did not start (KubeRay RayService).

`serveConfigV2` names `import_path: coordinator.deployment:app_builder` and passes
`args`: `CoordinatorConfig` fields by name (`model_dir`, `num_devices`, `dp`, ...; the
same keys as the `[serve]` table of `elasticmoe serve --config`), sizes in bytes, an
`autoscale` mapping of `AutoscaleConfig` fields, and adapters as `{name: directory}`.
API keys are never args (they would sit in the RayService object): they come from the
environment, `ELASTICMOE_API_KEY` and `ELASTICMOE_ADMIN_KEY`, set from a Secret.
"""

from __future__ import annotations

import os
from typing import Any

import pydantic

from coordinator.config import CoordinatorConfig
from coordinator.launch import coordinator_app
from elasticmoe.entrypoints.serve_settings import ADMIN_KEY_ENV, API_KEY_ENV
from elasticmoe.utils.settings import explain, secret_fields


def config_from_args(args: dict[str, Any], environ: dict[str, str] | None = None) -> CoordinatorConfig:
    """Raises `ValueError` naming the bad or unknown arg."""
    environ = dict(os.environ) if environ is None else environ
    secrets = sorted(set(args) & secret_fields(CoordinatorConfig))
    known = sorted(set(CoordinatorConfig.model_fields) - secret_fields(CoordinatorConfig))
    unknown = sorted(set(args) - set(known))
    if unknown:
        why = "keys come from $ELASTICMOE_API_KEY / $ELASTICMOE_ADMIN_KEY" if secrets else f"known: {', '.join(known)}"
        raise ValueError(f"serveConfigV2 args: unknown key(s) {', '.join(unknown)}; {why}")
    keys = {"api_key": environ.get(API_KEY_ENV) or None, "admin_key": environ.get(ADMIN_KEY_ENV) or None}
    try:
        return CoordinatorConfig.model_validate({**args, **{k: v for k, v in keys.items() if v is not None}})
    except pydantic.ValidationError as exc:
        raise ValueError(explain(exc, lambda loc: "serveConfigV2 args." + ".".join(map(str, loc)))) from None


def app_builder(args: dict[str, Any]) -> Any:
    """Serve's application builder (`import_path: coordinator.deployment:app_builder`)."""
    return coordinator_app(config_from_args(args))
