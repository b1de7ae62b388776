"""Expert offloading policies (FineMoE and baselines) as pure logic over statistics.

The engine owns the expert cache (`CacheState`) and does the copies; a policy
(`OffloadPolicy`) says what to prefetch and what to evict. Core library: imports torch and
numpy only. See docs/offload.md.
"""

from __future__ import annotations

from elasticmoe.offload.cache_ops import (
    CacheTooSmallError,
    CacheUpdate,
    load_on_demand,
    routed_experts,
    run_prefetch,
)
from elasticmoe.offload.cache_state import CacheState, ExpertKey
from elasticmoe.offload.policy import OffloadPolicy, PolicyConfig, PrefetchItem, PrefetchPlan, RequestContext
from elasticmoe.offload.registry import POLICIES, make_policy

__all__ = [
    "POLICIES",
    "CacheState",
    "CacheTooSmallError",
    "CacheUpdate",
    "ExpertKey",
    "OffloadPolicy",
    "PolicyConfig",
    "PrefetchItem",
    "PrefetchPlan",
    "RequestContext",
    "load_on_demand",
    "make_policy",
    "routed_experts",
    "run_prefetch",
]
