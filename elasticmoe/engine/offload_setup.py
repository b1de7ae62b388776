"""Build an engine's expert cache from its config: the budget in expert rows, the pool, the tier
the experts come from, and the hooks in the model's MoE blocks.

Budget: `expert_cache_bytes` buys `bytes // expert_bytes` rows (an expert is its w13 and w2
rows, in the dtype the engine keeps experts in); `expert_cache_fraction` is a share of the
rank's routed experts (all MoE layers), rounded up. On the elastic server the HMM allocates the
pool on the rank's device (`pool`, a flat byte buffer: as many rows as it holds; `hmm.layout`). A
budget below one token's top-k experts could never run a layer in one wave and is refused; a
budget above the rank's experts is lowered to them (nothing is ever evicted then).

ESFT adapter slots stay resident beside the cache (they are the hot set of adapters; those
beyond the slots wait on disk, `elasticmoe.engine.esft_disk_tier`): their rows are not part
of the cache's budget, like the KV cache.
"""

from __future__ import annotations

import logging
import math
import os

import torch

from elasticmoe.config import EngineConfig, ModelConfig
from elasticmoe.engine.expert_cache import ExpertCache
from elasticmoe.engine.expert_offload import ExpertOffload
from elasticmoe.engine.expert_sources import DiskExperts, ExpertSource, HostExperts, LayerExpertSpecs
from elasticmoe.models.common import CausalLM
from elasticmoe.models.weights import ParamSpec
from elasticmoe.offload.policy import PolicyConfig
from elasticmoe.offload.registry import make_policy
from elasticmoe.utils.numpy_blas import single_threaded_numpy_blas

logger = logging.getLogger(__name__)

GIB = 1 << 30
# How long the idle copy thread polls for the next plan's copies before it sleeps, where the
# engine's compute threads leave it a core (`copier_poll_us`). A decode step plans after every MoE
# layer, well within this; an idle server's copier sleeps after it.
COPIER_POLL_US = 2000


def copier_poll_us() -> int:
    """`COPIER_POLL_US` when this process computes on fewer threads than it has CPUs, else 0: a
    polling copier yields its core at every turn, but on a core the compute threads use it would
    still take time from them (and from a CPU quota)."""
    return COPIER_POLL_US if torch.get_num_threads() < len(os.sched_getaffinity(0)) else 0


def expert_layer_specs(specs: list[ParamSpec]) -> list[LayerExpertSpecs]:
    """The (w13, w2) stacks of every MoE layer, in layer order."""
    stacked = {s.name: s for s in specs if s.is_stacked}
    prefixes = sorted({name.rsplit(".", 1)[0] for name in stacked}, key=lambda p: int(p.split(".")[1]))
    return [LayerExpertSpecs(stacked[f"{p}.w13"], stacked[f"{p}.w2"]) for p in prefixes]


def cache_capacity(config: EngineConfig, num_rank_experts: int, top_k: int, expert_bytes: int) -> int:
    """Pool rows for the configured budget; `ValueError` naming the flag when it cannot run."""
    if config.expert_cache_bytes is not None:
        rows = config.expert_cache_bytes // expert_bytes
        given = f"--expert-cache-gb {config.expert_cache_bytes / GIB:.4g}"
    else:
        assert config.expert_cache_fraction is not None
        rows = math.ceil(config.expert_cache_fraction * num_rank_experts)
        given = f"--expert-cache-fraction {config.expert_cache_fraction:g}"
    if rows < top_k:
        raise ValueError(
            f"{given}: holds {rows} experts of {expert_bytes / (1 << 20):.3g} MiB; a token is routed to {top_k} "
            f"experts per layer, so the cache needs at least {top_k} ({top_k * expert_bytes / GIB:.4g} GB)")
    return min(rows, num_rank_experts)


def pool_rows(pool: torch.Tensor, num_rank_experts: int, top_k: int, expert_bytes: int) -> int:
    """Rows of a provided pool buffer the cache uses; `ValueError` when it cannot run."""
    rows = pool.numel() * pool.element_size() // expert_bytes
    if rows < top_k:
        raise ValueError(f"expert cache pool: {pool.numel() * pool.element_size()} B hold {rows} experts; a token is "
                         f"routed to {top_k} experts per layer, so the cache needs at least {top_k}")
    return min(rows, num_rank_experts)


def carve_pool(pool: torch.Tensor, rows: int, w13_shape: tuple[int, ...], w2_shape: tuple[int, ...],
               dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """`rows` w13 rows then `rows` w2 rows, as views of a flat byte buffer (no copy)."""
    raw = pool.view(torch.uint8).reshape(-1)
    item = torch.empty((), dtype=dtype).element_size()
    n13, n2 = rows * math.prod(w13_shape) * item, rows * math.prod(w2_shape) * item
    w13 = raw[:n13].view(dtype).view(rows, *w13_shape)
    w2 = raw[n13:n13 + n2].view(dtype).view(rows, *w2_shape)
    return w13, w2


def build_expert_offload(config: EngineConfig, model_cfg: ModelConfig, specs: list[ParamSpec],
                         weights: dict[str, torch.Tensor], dtype: torch.dtype,
                         local_expert_ids: tuple[int, ...],
                         pool: torch.Tensor | None = None) -> tuple[ExpertOffload, dict[str, torch.Tensor]]:
    """The engine's `ExpertOffload` and the pool tensors to build the model's MoE blocks over
    (every layer's `w13` / `w2` name maps to the same pool). `weights` holds the expert stacks
    when a provider gave them (the host tier); otherwise, or with `config.expert_tier == "disk"`
    (the provider's stacks then have no expert row mapped), the experts are read from the
    checkpoint (the disk tier). `pool`: the device's expert cache buffer (the HMM's), else private memory
    of the configured budget."""
    layers = expert_layer_specs(specs)
    w13_shape, w2_shape = layers[0].w13.shape[1:], layers[0].w2.shape[1:]
    expert_bytes = (math.prod(w13_shape) + math.prod(w2_shape)) * torch.empty((), dtype=dtype).element_size()
    num_rank_experts = len(layers) * len(local_expert_ids)
    if pool is not None:
        capacity = pool_rows(pool, num_rank_experts, model_cfg.top_k, expert_bytes)
        pool_w13, pool_w2 = carve_pool(pool, capacity, w13_shape, w2_shape, dtype)
    else:
        capacity = cache_capacity(config, num_rank_experts, model_cfg.top_k, expert_bytes)
        pool_w13 = torch.zeros((capacity, *w13_shape), dtype=dtype)
        pool_w2 = torch.zeros((capacity, *w2_shape), dtype=dtype)
    source: ExpertSource
    if config.expert_tier == "host" and layers[0].w13.name in weights:
        source = HostExperts([(weights[s.w13.name], weights[s.w2.name]) for s in layers])
    else:
        source = DiskExperts(config.model, layers, drop_pages=config.expert_page_cache == "drop")
    policy = make_policy(config.offload_policy, PolicyConfig(
        num_layers=len(layers), num_experts=model_cfg.num_experts, top_k=model_cfg.top_k,
        prefetch_distance=min(config.offload_prefetch_distance, len(layers)),
        store_capacity=config.offload_store_capacity))
    single_threaded_numpy_blas()  # the policy's products run inline; a spinning BLAS thread starves the copier
    cache = ExpertCache(policy, source, pool_w13, pool_w2, local_expert_ids, len(layers), model_cfg.num_experts,
                        copier_poll_us=copier_poll_us())
    routers = [weights[s.w13.name.rsplit(".", 1)[0] + ".router"] for s in layers]
    logger.info("expert offloading: %s, cache of %d of %d experts (%.1f MiB), experts from %s%s",
                policy.name, capacity, num_rank_experts, capacity * expert_bytes / (1 << 20), source.tier,
                " (page cache dropped after each read)" if source.drops_pages else "")
    offload = ExpertOffload(cache, routers, local_expert_ids, semantic=config.offload_semantic,
                            policy_thread=config.offload_policy_thread)
    pools = {name: pool for s in layers for name, pool in ((s.w13.name, pool_w13), (s.w2.name, pool_w2))}
    return offload, pools


def attach_expert_offload(model: CausalLM, offload: ExpertOffload, weights: dict[str, torch.Tensor],
                          num_local_experts: int, esft_rows: int = 0,
                          esft_dtype: torch.dtype = torch.float32) -> None:
    """Point every MoE block of `model` at the expert cache, and give its ESFT adapter slots
    (`esft_rows` = N*E_max rows) resident rows beside it: the rows past the base experts of a
    provider's virtual weight tensor (the HMM fills them), else fresh memory, which is only
    touched when an adapter is written into it."""
    for index, block in enumerate(model.moe_blocks()):
        block.offload, block.moe_index = offload, index
        if not esft_rows:
            continue
        rows = []
        for name, pool in ((f"{block.prefix}.w13", offload.cache.w13), (f"{block.prefix}.w2", offload.cache.w2)):
            stack = weights.get(name)
            rows.append(stack[num_local_experts:] if stack is not None
                        else torch.empty((esft_rows, *pool.shape[1:]), dtype=esft_dtype))
        block.esft_rows = (rows[0], rows[1])
