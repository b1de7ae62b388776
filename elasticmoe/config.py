"""Internal configuration: the model (parsed from an HF `config.json`) and the engine.

Both are frozen dataclasses validated in `__post_init__`; user-facing options
(CLI, HTTP) are converted into these in one place.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from elasticmoe.adapter_policy.arranging import arranger
from elasticmoe.adapter_policy.eviction import eviction_policy
from elasticmoe.adapters.lora_targets import parse_target_modules

if TYPE_CHECKING:
    import torch

SUPPORTED_ARCHS = ("qwen3_moe", "mixtral", "deepseek_v2")

DTYPE_NAMES = ("bfloat16", "float16", "float32")
EXPERT_PAGE_CACHE = ("keep", "drop")  # `EngineConfig.expert_page_cache`


def parse_dtype(name: str | torch.dtype) -> torch.dtype:
    # NOTE: torch is imported here, not with the module: the elastic server's ingress reads
    # this module's configs and must not load PyTorch (`coordinator.ingress`).
    import torch

    if isinstance(name, torch.dtype):
        return name
    if name not in DTYPE_NAMES:
        raise ValueError(f"dtype: expected one of {list(DTYPE_NAMES)}, got {name!r}")
    dtype: torch.dtype = getattr(torch, name)
    return dtype


def parse_engine_dtype(name: str | torch.dtype | None) -> torch.dtype | None:
    """`parse_dtype`, plus "auto" (and None) -> None: the engine picks the fastest exact dtype for
    the checkpoint on this CPU (`elasticmoe.utils.cpu_features.choose_compute_plan`)."""
    if name is None or name == "auto":
        return None
    return parse_dtype(name)


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """Architecture facts the engine needs, normalised across the three families."""

    arch: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int  # dense MLP width (DeepSeek dense layers)
    moe_intermediate_size: int
    num_experts: int
    top_k: int
    norm_topk_prob: bool
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    moe_layer_ids: tuple[int, ...]
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None
    # DeepSeek-V2 specifics (MLA + routing); zero/None elsewhere.
    num_shared_experts: int = 0
    kv_lora_rank: int = 0
    q_lora_rank: int | None = None
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    topk_method: str = "greedy"
    num_groups: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    extra: dict = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        if self.arch not in SUPPORTED_ARCHS:
            raise ValueError(f"model_type: {self.arch!r} is not supported (supported: {', '.join(SUPPORTED_ARCHS)})")
        if self.num_heads % self.num_kv_heads:
            raise ValueError("num_key_value_heads must divide num_attention_heads")
        if not 0 < self.top_k <= self.num_experts:
            raise ValueError(f"num_experts_per_tok must be in [1, num_experts], got {self.top_k}")
        if self.topk_method not in ("greedy", "group_limited_greedy"):
            raise ValueError(f"topk_method {self.topk_method!r} is not supported")
        if self.num_experts % self.num_groups:
            raise ValueError("n_group must divide n_routed_experts")

    @property
    def is_mla(self) -> bool:
        return self.arch == "deepseek_v2"

    def is_moe_layer(self, layer_id: int) -> bool:
        return layer_id in self.moe_layer_ids

    @classmethod
    def from_pretrained(cls, model_dir: str | os.PathLike) -> ModelConfig:
        path = Path(model_dir) / "config.json"
        if not path.is_file():
            raise FileNotFoundError(f"model: no config.json in {model_dir}")
        return cls.from_hf_dict(json.loads(path.read_text()))

    @classmethod
    def from_hf_dict(cls, c: dict) -> ModelConfig:
        arch = c.get("model_type", "")
        if arch not in SUPPORTED_ARCHS:
            raise ValueError(f"model_type: {arch!r} is not supported (supported: {', '.join(SUPPORTED_ARCHS)})")
        rope = c.get("rope_parameters") or c.get("rope_scaling") or {}
        if rope and rope.get("rope_type", rope.get("type", "default")) != "default":
            raise ValueError(f"rope_scaling: only default RoPE is supported, got {rope}")
        rope_theta = float(rope.get("rope_theta", c.get("rope_theta", 10000.0)))
        num_layers = c["num_hidden_layers"]
        num_heads = c["num_attention_heads"]
        eos = c.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        common = dict(
            arch=arch,
            vocab_size=c["vocab_size"],
            hidden_size=c["hidden_size"],
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=c.get("num_key_value_heads") or num_heads,
            rms_norm_eps=float(c.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            max_position_embeddings=c.get("max_position_embeddings", 4096),
            tie_word_embeddings=bool(c.get("tie_word_embeddings", False)),
            eos_token_ids=eos_ids,
            bos_token_id=c.get("bos_token_id"),
            extra=c,
        )
        if arch == "qwen3_moe":
            sparse_step = c.get("decoder_sparse_step", 1)
            mlp_only = set(c.get("mlp_only_layers") or [])
            num_experts = c.get("num_experts") or c["num_local_experts"]
            moe_ids = tuple(
                i for i in range(num_layers) if i not in mlp_only and num_experts > 0 and (i + 1) % sparse_step == 0
            )
            return cls(
                **common,
                head_dim=c.get("head_dim") or c["hidden_size"] // num_heads,
                intermediate_size=c["intermediate_size"],
                moe_intermediate_size=c["moe_intermediate_size"],
                num_experts=num_experts,
                top_k=c["num_experts_per_tok"],
                norm_topk_prob=bool(c.get("norm_topk_prob", False)),
                moe_layer_ids=moe_ids,
            )
        if arch == "mixtral":
            return cls(
                **common,
                head_dim=c.get("head_dim") or c["hidden_size"] // num_heads,
                intermediate_size=c["intermediate_size"],
                moe_intermediate_size=c["intermediate_size"],
                num_experts=c["num_local_experts"],
                top_k=c["num_experts_per_tok"],
                norm_topk_prob=True,
                moe_layer_ids=tuple(range(num_layers)),
            )
        # deepseek_v2
        first_dense = c.get("first_k_dense_replace", 0)
        freq = c.get("moe_layer_freq", 1)
        num_experts = c["n_routed_experts"]
        return cls(
            **common,
            head_dim=c["qk_nope_head_dim"] + c["qk_rope_head_dim"],
            intermediate_size=c["intermediate_size"],
            moe_intermediate_size=c["moe_intermediate_size"],
            num_experts=num_experts,
            top_k=c["num_experts_per_tok"],
            norm_topk_prob=bool(c.get("norm_topk_prob", False)),
            moe_layer_ids=tuple(i for i in range(num_layers) if i >= first_dense and i % freq == 0),
            num_shared_experts=c.get("n_shared_experts") or 0,
            kv_lora_rank=c["kv_lora_rank"],
            q_lora_rank=c.get("q_lora_rank"),
            qk_nope_head_dim=c["qk_nope_head_dim"],
            qk_rope_head_dim=c["qk_rope_head_dim"],
            v_head_dim=c["v_head_dim"],
            topk_method=c.get("topk_method", "greedy"),
            num_groups=c.get("n_group") or 1,
            topk_group=c.get("topk_group") or 1,
            routed_scaling_factor=float(c.get("routed_scaling_factor", 1.0)),
        )


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """How one engine instance runs: memory, batching and parallel layout."""

    model: str
    # Weights and activations. None ("auto"): the checkpoint's dtype if this CPU computes it fast,
    # else float32. A 16-bit dtype without a fast GEMM here is computed in float32
    # (`elasticmoe.utils.cpu_features`); the engine's own config then says float32.
    dtype: torch.dtype | None = field(default_factory=lambda: parse_dtype("bfloat16"))
    block_size: int = 16
    num_kv_blocks: int | None = None  # None: derive from kv_cache_bytes
    kv_cache_bytes: int = 1 << 30
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 256
    max_model_len: int | None = None  # None: the model's max_position_embeddings
    # Full KV blocks stay named after their requests end; a request whose first tokens (and
    # adapter) match takes them instead of computing them again (`engine.block_manager`).
    enable_prefix_caching: bool = True
    seed: int = 0
    num_threads: int | None = None  # torch intra-op threads; None leaves torch's default
    ep_rank: int = 0
    ep_size: int = 1
    # ESFT adapters (ExpertWeave): N slots of at most E_max tuned experts per MoE layer each.
    max_esft_adapters: int = 0
    max_esft_experts: int = 0
    # LoRA adapters: S fixed slots of rank up to max_lora_rank (attention and expert projections).
    max_loras: int = 0
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None  # adapters kept in host memory (>= max_loras); None: max_loras
    # The module names LoRA slots hold (PEFT's `target_modules` names); None: every module the model
    # can serve. A slot costs only these modules' factors (the experts' are most of a full slot).
    lora_target_modules: tuple[str, ...] | None = None
    max_lora_topk: int = 2  # adapters one token may combine (learned routing); fixed per step for EP
    # The first `scheduling_window` waiting requests are admitted grouped by LoRA adapter (CoServe §4.2).
    scheduling_window: int = 16
    # CoServe policies (elasticmoe.adapter_policy): which resident LoRA adapter a swap evicts
    # ("coserve": two-stage, §4.3; "lru"; "fifo") and the admission order inside the window
    # ("coserve": grouped by adapter, §4.2; "fcfs"); a profile (`elasticmoe profile`) whose usage
    # probabilities the eviction prefers over declared ones and over observed rates.
    adapter_eviction: str = "coserve"
    request_arranging: str = "coserve"
    adapter_profile: str | None = None
    # Expert offloading (FineMoE): the routed experts live in an expert cache of this many bytes, or
    # of this fraction of the rank's routed experts (set one), loaded on demand and prefetched by
    # `offload_policy` ("finemoe", "lru", "lfu", "on_demand"; `elasticmoe.offload.registry`).
    expert_cache_bytes: int | None = None
    expert_cache_fraction: float | None = None
    offload_policy: str = "finemoe"
    offload_prefetch_distance: int = 1  # FineMoE's d (§4.2); LFU's too
    offload_store_capacity: int = 1000  # FineMoE's Expert Map Store capacity C (§4.4)
    # FineMoE's semantic embedding (§4.2.1): over the tokens each iteration feeds ("iteration") or
    # the prompt's at every iteration ("prompt"); `elasticmoe.offload.policy.SEMANTIC_SOURCES`.
    offload_semantic: str = "iteration"
    # The policy's searches and plans run on the forward thread, each layer's once its experts are
    # ensured (False), or on a thread beside the forward (True; `elasticmoe.engine.expert_offload`).
    offload_policy_thread: bool = False
    # Where the experts the cache does not hold are read from: "host" (a provider's full stacks,
    # the elastic server's node memory, when given; else the checkpoint) or "disk" (the checkpoint
    # always: the provider's stacks then have no expert row mapped).
    expert_tier: str = "host"
    # What the OS page cache does with the experts read from the checkpoint: "keep" them (re-reads
    # come from memory, outside the cache's budget) or "drop" each read's pages (the experts take no
    # memory beyond the cache: a checkpoint larger than the host's memory; every miss reads the disk).
    expert_page_cache: str = "keep"

    def __post_init__(self) -> None:
        _check_offload(self)
        if self.max_esft_adapters < 0 or self.max_esft_experts < 0:
            raise ValueError("max_esft_adapters / max_esft_experts: must be >= 0")
        if self.max_loras < 0 or self.max_lora_rank < 1:
            raise ValueError("max_loras: must be >= 0 and max_lora_rank >= 1")
        if self.max_esft_adapters and not self.max_esft_experts:
            raise ValueError("max_esft_experts: must be >= 1 when max_esft_adapters > 0")
        parse_target_modules(self.lora_target_modules)
        if self.block_size < 1:
            raise ValueError(f"block_size: must be >= 1, got {self.block_size}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError(f"num_kv_blocks: must be >= 1, got {self.num_kv_blocks}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens: must be >= 1, got {self.max_num_batched_tokens}")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs: must be >= 1, got {self.max_num_seqs}")
        if self.scheduling_window < 1:
            raise ValueError(f"scheduling_window: must be >= 1, got {self.scheduling_window}")
        if not 0 <= self.ep_rank < self.ep_size:
            raise ValueError(f"ep_rank: must be in [0, ep_size), got {self.ep_rank} of {self.ep_size}")
        _check_policies(self.adapter_eviction, self.request_arranging)

    @property
    def offloads_experts(self) -> bool:
        return self.expert_cache_bytes is not None or self.expert_cache_fraction is not None


def _check_offload(config: EngineConfig | EngineOptions) -> None:
    """`ValueError` naming the option for an invalid expert-offloading setting."""
    from elasticmoe.offload.policy import SEMANTIC_SOURCES
    from elasticmoe.offload.registry import POLICIES

    if config.expert_cache_bytes is not None and config.expert_cache_fraction is not None:
        raise ValueError("expert_cache_bytes / expert_cache_fraction: set one, not both")
    if config.expert_cache_bytes is not None and config.expert_cache_bytes <= 0:
        raise ValueError(f"expert_cache_bytes: must be > 0, got {config.expert_cache_bytes}")
    if config.expert_cache_fraction is not None and not 0.0 < config.expert_cache_fraction <= 1.0:
        raise ValueError(f"expert_cache_fraction: must be in (0, 1], got {config.expert_cache_fraction}")
    if config.offload_policy not in POLICIES:
        raise ValueError(f"offload_policy: unknown {config.offload_policy!r}, choose one of {', '.join(POLICIES)}")
    if config.offload_prefetch_distance < 1 or config.offload_store_capacity < 1:
        raise ValueError("offload_prefetch_distance / offload_store_capacity: must be >= 1")
    if config.offload_semantic not in SEMANTIC_SOURCES:
        raise ValueError(f"offload_semantic: unknown {config.offload_semantic!r}, "
                         f"choose one of {', '.join(SEMANTIC_SOURCES)}")
    if config.expert_tier not in ("host", "disk"):
        raise ValueError(f"expert_tier: unknown {config.expert_tier!r}, choose host or disk")
    if config.expert_page_cache not in EXPERT_PAGE_CACHE:
        raise ValueError(f"expert_page_cache: unknown {config.expert_page_cache!r}, choose keep or drop")


def _check_policies(adapter_eviction: str, request_arranging: str) -> None:
    """`ValueError` naming the option unless both name registered policies."""
    eviction_policy(adapter_eviction)
    arranger(request_arranging)


@dataclass(frozen=True, slots=True)
class EngineOptions:
    """What a server sets for every engine it builds; the rest of an `EngineConfig` (the model,
    the EP layout, the KV pool) comes from where the engine runs. None: the engine's default."""

    dtype: torch.dtype | None = field(default_factory=lambda: parse_dtype("float32"))  # None: "auto" (EngineConfig)
    num_threads: int | None = None
    max_model_len: int | None = None
    max_num_batched_tokens: int | None = None
    max_num_seqs: int | None = None
    kv_cache_bytes: int | None = None
    enable_prefix_caching: bool = True
    max_esft_adapters: int = 0
    max_esft_experts: int = 0
    max_loras: int = 0
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None
    lora_target_modules: tuple[str, ...] | None = None  # see EngineConfig
    adapter_eviction: str = "coserve"  # "coserve" (two-stage, CoServe §4.3), "lru", "fifo"
    request_arranging: str = "coserve"  # "coserve" (grouped by adapter in the window, §4.2), "fcfs"
    adapter_profile: str | None = None  # a profile JSON (`elasticmoe profile`): usage probabilities
    expert_cache_bytes: int | None = None  # expert offloading: see EngineConfig
    expert_cache_fraction: float | None = None
    offload_policy: str = "finemoe"
    offload_prefetch_distance: int = 1
    offload_store_capacity: int = 1000
    offload_semantic: str = "iteration"
    expert_tier: str = "host"
    expert_page_cache: str = "keep"

    def __post_init__(self) -> None:
        _check_offload(self)
        _check_policies(self.adapter_eviction, self.request_arranging)
        parse_target_modules(self.lora_target_modules)

    def engine_config(self, model: str, **placement: Any) -> EngineConfig:
        """This engine's config; `placement` are the fields only its place knows (ep_rank, ...)."""
        given: dict[str, Any] = {f: getattr(self, f) for f in self.__dataclass_fields__ if getattr(self, f) is not None}
        given["dtype"] = self.dtype  # None passes through: the engine picks ("auto")
        return EngineConfig(model=model, **given, **placement)
