"""Schemathesis, driven without its pytest plugin (which does not run on this pytest): every
operation of an OpenAPI document, requests generated in positive and negative mode by
Hypothesis (seeded), each answer checked. Shared by the single-process and elastic server tests.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.config import SchemathesisConfig
from schemathesis.config._checks import NEGATIVE_DATA_REJECTION_EXPECTED_STATUSES
from schemathesis.specs.openapi.checks import negative_data_rejection

CHECKS = [not_a_server_error, negative_data_rejection]

# Schemathesis's statuses that count as rejecting invalid data, and 413: a body over the servers'
# size limit (Hypothesis once made a negative chat request of 11 MB) is refused by its size before
# it is parsed, which is the rejection a client of an OpenAI server gets.
CONFIG = SchemathesisConfig.from_dict({"checks": {"negative_data_rejection": {
    "expected-statuses": [*NEGATIVE_DATA_REJECTION_EXPECTED_STATUSES, "413"]}}})


def fuzz(schema: Any, max_examples: int, after_each: Callable[[], None] = lambda: None,
         **call_kwargs: Any) -> dict[str, int]:
    """Run every operation of `schema` in both modes; returns calls made per `METHOD path mode`.
    Raises the first failed check (with the request that failed it)."""
    calls: dict[str, int] = {}
    for result in schema.get_all_operations():
        operation = result.ok()
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
            key = f"{operation.method.upper()} {operation.path} {mode.value}"
            calls[key] = 0
            _run(operation.as_strategy(generation_mode=mode), key, calls, max_examples, after_each, call_kwargs)
    return calls


def _run(strategy: Any, key: str, calls: dict[str, int], max_examples: int, after_each: Callable[[], None],
         call_kwargs: dict[str, Any]) -> None:
    @settings(max_examples=max_examples, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))
    @given(case=strategy)
    def run(case: Any) -> None:
        case.call_and_validate(checks=CHECKS, **call_kwargs)
        calls[key] += 1
        after_each()

    try:
        run()
    except Unsatisfiable:
        if not key.endswith("negative"):
            raise
        # An operation without parameters or body has no invalid request (GET /health).
