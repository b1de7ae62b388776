"""`ServeSettings`: what `elasticmoe serve` is asked to run, declared once for both servers.

Every field is a flag of `elasticmoe serve`, a key of the `[serve]` table of `--config`
and (for the elastic server, `coordinator.config.CoordinatorConfig`, which extends
this) an arg of the RayService's `serveConfigV2` (see `elasticmoe.utils.settings`).
Sizes are bytes in the file and the args, GiB on the command line. Validated once: an
invalid combination raises a `ValidationError` whose messages name the option, so
the CLI exits 2 before anything starts.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, SecretStr, model_validator

from elasticmoe.adapters.lora_targets import check_served, parse_target_modules
from elasticmoe.config import EngineOptions, ModelConfig, parse_dtype
from elasticmoe.entrypoints.openai.access import (
    DEFAULT_MAX_BODY_BYTES,
    DEFAULT_MAX_HEADER_BYTES,
    AccessPolicy,
)
from elasticmoe.utils.settings import GIB, cli, reveal

if TYPE_CHECKING:
    import torch

API_KEY_ENV = "ELASTICMOE_API_KEY"
ADMIN_KEY_ENV = "ELASTICMOE_ADMIN_KEY"


def _named_dirs(value: Any, option: str) -> Any:
    """NAME=DIR flags, a {name: dir} table or (name, dir) pairs -> (name, dir) pairs."""
    if isinstance(value, dict):
        return tuple((name, path) for name, path in value.items())
    if not isinstance(value, (list, tuple)):
        return value  # the type check names it
    pairs = []
    for item in value:
        if isinstance(item, str):
            name, sep, path = item.partition("=")
            if not sep or not name or not path:
                raise ValueError(f"{option}: want NAME=DIR, got {item!r}")
            item = (name, path)
        pairs.append(tuple(item))
    names = [pair[0] for pair in pairs]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise ValueError(f"{option}: {twice[0]!r} given twice")
    return tuple(pairs)


NamedDirs = tuple[tuple[str, str], ...]
EsftDirs = Annotated[NamedDirs, BeforeValidator(lambda v: _named_dirs(v, "--esft-adapter"))]
TargetModules = Annotated[tuple[str, ...] | None,
                          BeforeValidator(lambda v: parse_target_modules(v, "--lora-target-modules"))]
LoraDirs = Annotated[NamedDirs, BeforeValidator(lambda v: _named_dirs(v, "--lora-adapter"))]


class ServeSettings(BaseModel):
    """The model, its limits, the adapters it serves, access and shutdown."""

    model_config = ConfigDict(frozen=True, extra="forbid", strict=True, hide_input_in_errors=True)

    model_dir: str = Field(description="directory of an HF checkpoint (config.json, safetensors, tokenizer)",
                           json_schema_extra=cli("--model", metavar="DIR"))
    dtype: Literal["float32", "bfloat16"] = Field(
        "float32", description="weight and activation dtype (default float32, the fast choice on most CPUs)")
    served_model_name: str | None = Field(
        None, description="model name clients pass as `model` (default: the model directory's name)",
        json_schema_extra=cli(metavar="NAME"))
    reasoning_parser: Literal["qwen3", "deepseek_r1"] | None = Field(
        None, description="return a reasoning model's thinking (<think>...</think>) apart from its answer, as the "
        "chat message's `reasoning` (also `reasoning_content`), as vLLM's flag: qwen3 (a request may turn thinking "
        "off with chat_template_kwargs {\"enable_thinking\": false}) or deepseek_r1 (default: none, the thinking "
        "stays in the content)")
    max_model_len: int | None = Field(
        None, description="context length limit, prompt plus output tokens (default: the model's maximum; "
        "a smaller KV cache lowers it)", json_schema_extra=cli(metavar="N"))
    kv_bytes_per_device: int | None = Field(
        None, description="memory for the paged KV cache; elastic server: per device (default: 1 GiB single, "
        "min(0.25 GiB, device memory / 4) elastic)", json_schema_extra=cli("--kv-cache-gb", metavar="GB", unit=GIB))
    max_num_batched_tokens: int | None = Field(
        None, description="token budget of one engine step across all requests (default: the engine's, 2048)",
        json_schema_extra=cli(metavar="N"))
    max_num_seqs: int | None = Field(
        None, description="requests one engine (one rank) runs at once; more wait in its queue (default: the "
        "engine's, 256)", json_schema_extra=cli(metavar="N"))
    enable_prefix_caching: bool = Field(
        True, description="keep full KV blocks after their requests end and start a request whose first tokens "
        "(and adapter) match past them, as vLLM's automatic prefix caching: shared system prompts and earlier "
        "turns of a chat are not computed again. The cache lives in the KV pool's idle blocks, so the resident "
        "KV memory grows toward --kv-cache-gb; --no-enable-prefix-caching turns it off")
    num_threads: int | None = Field(
        None, description="torch threads of each engine (elastic: 1 per rank, ranks share the node's cores; "
        "single: torch's default)", json_schema_extra=cli(metavar="N"))

    max_esft_adapters: int = Field(
        4, description="ESFT adapter slots (0 disables ESFT adapters). Slots cost address space, not memory: "
        "physical memory is used only by the experts an adapter tunes. The elastic server registers more "
        "adapters than slots and swaps them in when a request needs one (--adapter-eviction picks what leaves)",
        json_schema_extra=cli(metavar="N"))
    max_esft_experts: int = Field(16, description="most experts one ESFT adapter may tune in one layer (E_max)",
                                  json_schema_extra=cli(metavar="E"))
    esft_adapters: EsftDirs = Field(
        (), description="load an ESFT adapter (expert_cfg.json + safetensors) at start; clients select it with "
        "model=NAME. Repeatable; POST /admin/adapters loads more at run time",
        json_schema_extra=cli("--esft-adapter", metavar="NAME=DIR"))
    max_loras: int = Field(0, description="LoRA slots, allocated at start with fixed addresses (0: LoRA off)",
                           json_schema_extra=cli(metavar="S"))
    max_lora_rank: int = Field(16, description="largest LoRA rank a slot holds", json_schema_extra=cli(metavar="R"))
    max_cpu_loras: int | None = Field(
        None, description="LoRA adapters kept loaded in host memory, >= --max-loras (default: --max-loras); beyond "
        "the slots they are swapped in when a request needs them (the elastic server's ranks swap together)",
        json_schema_extra=cli(metavar="C"))
    lora_target_modules: TargetModules = Field(
        None, description="the modules LoRA slots hold, comma-separated PEFT names (e.g. q_proj,v_proj; default: "
        "every module the model has, the experts' gate/up/down too). A slot costs only these modules' factors: "
        "on the small Qwen3-MoE (rank 8, float32) 0.66 MB for q_proj,v_proj against 24.3 MB for all, so the same "
        "memory holds ~37x the slots. An adapter on other modules is refused (400, param target_modules)",
        json_schema_extra=cli(metavar="NAMES"))
    adapter_eviction: Literal["coserve", "lru", "fifo"] = Field(
        "coserve", description="which adapter leaves a full hot set: coserve (adapters stranded by their "
        "dependencies first, then the least likely to be used: CoServe §4.3; LoRA adapters with a declared or "
        "profiled usage probability are also preloaded into the slots, most probable first: §4.1), lru, or fifo")
    request_arranging: Literal["coserve", "fcfs"] = Field(
        "coserve", description="admission order inside the scheduling window: coserve (grouped by adapter, "
        "oldest group first, no starvation: CoServe §4.2) or fcfs")
    profile: str | None = Field(
        None, description="a profile written by `elasticmoe profile`: adapters' usage probabilities for eviction "
        "and assignment, and (unless given) the memory split: KV cache (elastic: per device), --max-num-seqs, "
        "--max-loras (and --lora-target-modules, the slots it was sized for), --max-esft-adapters",
        json_schema_extra=cli(metavar="FILE"))
    expert_cache_bytes: int | None = Field(
        None, description="expert offloading (FineMoE): keep the routed experts in a cache of this size per engine "
        "(elastic: per device, allocated by the HMM) and load the others on demand from the checkpoint (single) or "
        "the node's host memory (elastic, where a scale-down onto devices that cannot hold every expert then "
        "offloads instead of being refused); outputs are unchanged. ESFT adapter slots stay resident beside the "
        "cache (not part of its size), and LoRA adapters' factors stay resident on the attention and the experts "
        "alike (default: off, every expert resident)", json_schema_extra=cli("--expert-cache-gb", metavar="GB", unit=GIB))
    expert_cache_fraction: float | None = Field(
        None, description="expert offloading with a cache of this fraction (0-1] of the routed experts instead of "
        "a size (elastic: of a device's experts at the first --dp; the size then stays through scales)",
        json_schema_extra=cli(metavar="F"))
    offload_policy: Literal["finemoe", "lru", "lfu", "on_demand"] = Field(
        "finemoe", description="what the expert cache prefetches and evicts: finemoe (expert maps, semantic and "
        "trajectory search), lru (Mixtral-Offloading: next-layer speculation, LRU within each layer's share), lfu "
        "(MoE-Infinity: request-level activation matrices) or on_demand (no prefetching, LRU within each layer's "
        "share); docs/operations.md says which to pick")
    offload_prefetch_distance: int = Field(
        1, description="how many layers ahead finemoe and lfu predict and prefetch (FineMoE's d)",
        json_schema_extra=cli(metavar="D"))
    expert_page_cache: Literal["keep", "drop"] = Field(
        "keep", description="with expert offloading from the checkpoint, what the OS page cache does with the "
        "experts read: keep them (a miss is then a copy from memory, outside the cache's size) or drop each read's "
        "pages (the experts take no memory beyond the cache and every miss reads the disk: what a checkpoint larger "
        "than the host's memory gets; elastic: with --expert-tier disk)", json_schema_extra=cli(metavar="P"))
    lora_adapters: LoraDirs = Field(
        (), description="load a LoRA adapter (adapter_config.json + adapter_model.safetensors) at start; clients "
        "select it with model=NAME. Repeatable; POST /admin/adapters with type=lora loads more at run time",
        json_schema_extra=cli("--lora-adapter", metavar="NAME=DIR"))

    api_key: SecretStr | None = Field(
        None, description="require 'Authorization: Bearer KEY' on /v1/*; /health, /ready, /metrics stay open",
        json_schema_extra=cli(metavar="KEY", env=API_KEY_ENV))
    admin_key: SecretStr | None = Field(
        None, description="require this key on /admin/* and the API docs; without it they take the API key",
        json_schema_extra=cli(metavar="KEY", env=ADMIN_KEY_ENV))
    max_body_bytes: int = Field(DEFAULT_MAX_BODY_BYTES, description="larger request bodies get 413",
                                json_schema_extra=cli(metavar="N"))
    max_header_bytes: int = Field(DEFAULT_MAX_HEADER_BYTES, description="larger request headers get 431",
                                  json_schema_extra=cli(metavar="N"))
    shutdown_timeout_s: float = Field(
        30.0, description="on SIGTERM/SIGINT (or POST /admin/drain) new requests get 503 and those in flight get "
        "up to S seconds to finish before the server stops", json_schema_extra=cli("--shutdown-timeout", metavar="S"))

    @model_validator(mode="before")
    @classmethod
    def _profile_split(cls, values: Any) -> Any:
        """The profile's memory split fills the settings it covers that were not given (`fill_from_profile`)."""
        return fill_from_profile(values)

    @model_validator(mode="after")
    def _check(self) -> ServeSettings:
        for name in ("max_model_len", "max_num_batched_tokens", "max_num_seqs", "num_threads"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"--{name.replace('_', '-')}: must be >= 1, got {value}")
        if self.kv_bytes_per_device is not None and self.kv_bytes_per_device <= 0:
            raise ValueError(f"--kv-cache-gb: must be > 0, got {self.kv_bytes_per_device / GIB:g}")
        if self.max_esft_adapters < 0 or self.max_esft_experts < 1:
            raise ValueError("--max-esft-adapters: must be >= 0 and --max-esft-experts >= 1")
        if self.esft_adapters and self.max_esft_adapters < 1:  # beyond the slots they wait on disk
            raise ValueError(
                f"--max-esft-adapters: {self.max_esft_adapters} slots for {len(self.esft_adapters)} --esft-adapter")
        if self.max_loras < 0 or self.max_lora_rank < 1:
            raise ValueError("--max-loras: must be >= 0 and --max-lora-rank >= 1")
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ValueError("--max-cpu-loras: must be >= --max-loras")
        if self.lora_target_modules is not None and self.max_loras < 1:
            raise ValueError("--lora-target-modules: the modules of LoRA slots; give --max-loras too")
        if self.lora_adapters and self.max_loras < 1:
            raise ValueError(f"--max-loras: {self.max_loras} slots for {len(self.lora_adapters)} --lora-adapter")
        held = self.max_cpu_loras if self.max_cpu_loras is not None else self.max_loras
        if len(self.lora_adapters) > held:
            raise ValueError(f"--max-cpu-loras: {held} adapters fit for {len(self.lora_adapters)} --lora-adapter")
        both = sorted({n for n, _ in self.esft_adapters} & {n for n, _ in self.lora_adapters})
        if both:
            raise ValueError(f"--lora-adapter: names {both} are ESFT adapters too")
        if self.offloads_experts:
            self._check_offload()
        elif self.expert_page_cache == "drop":
            raise ValueError("--expert-page-cache drop: only experts an expert cache reads from the checkpoint are "
                             "dropped; give --expert-cache-gb or --expert-cache-fraction")
        if self.profile is not None and not Path(self.profile).is_file():
            raise ValueError(f"--profile: {self.profile} is not a file (write one with `elasticmoe profile`)")
        if not 0 <= self.shutdown_timeout_s <= 3600:
            raise ValueError(f"--shutdown-timeout: must be between 0 and 3600 s, got {self.shutdown_timeout_s:g}")
        self.access  # noqa: B018 - validates the keys and limits
        if not (Path(self.model_dir) / "config.json").is_file():
            raise ValueError(f"--model: {self.model_dir} has no config.json (make one with `elasticmoe make-model`)")
        if self.lora_target_modules is not None:  # before anything starts: a rank would fail on it at start
            check_served(self.lora_target_modules, ModelConfig.from_pretrained(self.model_dir), "--lora-target-modules")
        return self

    @property
    def offloads_experts(self) -> bool:
        return self.expert_cache_bytes is not None or self.expert_cache_fraction is not None

    def _check_offload(self) -> None:
        if self.expert_cache_bytes is not None and self.expert_cache_fraction is not None:
            raise ValueError("--expert-cache-gb: give it or --expert-cache-fraction, not both")
        if self.expert_cache_bytes is not None and self.expert_cache_bytes <= 0:
            raise ValueError(f"--expert-cache-gb: must be > 0, got {self.expert_cache_bytes / GIB:g}")
        if self.expert_cache_fraction is not None and not 0.0 < self.expert_cache_fraction <= 1.0:
            raise ValueError(f"--expert-cache-fraction: must be in (0, 1], got {self.expert_cache_fraction:g}")
        if self.offload_prefetch_distance < 1:
            raise ValueError(f"--offload-prefetch-distance: must be >= 1, got {self.offload_prefetch_distance}")

    @property
    def access(self) -> AccessPolicy:
        return AccessPolicy(api_key=reveal(self.api_key), admin_key=reveal(self.admin_key),
                            max_body_bytes=self.max_body_bytes, max_header_bytes=self.max_header_bytes)

    @property
    def torch_dtype(self) -> torch.dtype:
        return parse_dtype(self.dtype)

    @property
    def model_name(self) -> str:
        """The name clients pass as `model`."""
        return self.served_model_name or Path(self.model_dir).resolve().name

    @property
    def esft_slots(self) -> tuple[int, int]:
        """(N, E_max) of the ESFT adapter slots; (0, 0) without any."""
        if not self.max_esft_adapters:
            return (0, 0)
        return (self.max_esft_adapters, self.max_esft_experts)

    def engine_options(self) -> EngineOptions:
        """What every engine of this server is built with (the elastic server's KV pool comes from its HMM).
        A profile's memory split is already in the settings (`fill_from_profile`)."""
        slots, experts = self.esft_slots
        return EngineOptions(
            dtype=self.torch_dtype, num_threads=self.num_threads, max_model_len=self.max_model_len,
            max_num_batched_tokens=self.max_num_batched_tokens, max_num_seqs=self.max_num_seqs,
            kv_cache_bytes=self.kv_bytes_per_device, max_esft_adapters=slots, max_esft_experts=experts,
            max_loras=self.max_loras, enable_prefix_caching=self.enable_prefix_caching,
            max_lora_rank=self.max_lora_rank, max_cpu_loras=self.max_cpu_loras,
            lora_target_modules=self.lora_target_modules, adapter_eviction=self.adapter_eviction,
            request_arranging=self.request_arranging,
            adapter_profile=self.profile, expert_cache_bytes=self.expert_cache_bytes,
            expert_cache_fraction=self.expert_cache_fraction, offload_policy=self.offload_policy,
            offload_prefetch_distance=self.offload_prefetch_distance, expert_page_cache=self.expert_page_cache,
        )


# The settings a profile's memory split covers: its `MemorySplit.engine_fields()` key -> settings field.
_SPLIT_SETTINGS = {"kv_cache_bytes": "kv_bytes_per_device", "max_num_seqs": "max_num_seqs",
                   "max_loras": "max_loras", "max_esft_adapters": "max_esft_adapters",
                   "lora_target_modules": "lora_target_modules"}


def fill_from_profile(values: Any) -> Any:
    """Settings `values` (a dict of field values, before validation) with a `profile` whose memory
    split (CoServe §4.4) covers the KV cache, --max-num-seqs, --max-loras (with the modules the slots
    hold, when the profile was measured for some: their bytes sized the slot count) and --max-esft-adapters:
    those not given (absent or None) take the split's values, once, so every reader of the settings
    (the engines, the HMM's KV pool, the slot counts on /admin/status) sees the same. A profile file
    that does not exist is left to the `--profile` check, one that does not parse is refused naming
    the flag, one without a split changes nothing."""
    if not isinstance(values, dict) or not values.get("profile") or not Path(values["profile"]).is_file():
        return values
    from elasticmoe.adapter_policy.profile import load_profile

    try:
        split = load_profile(values["profile"]).memory_split
    except ValueError as exc:
        raise ValueError(f"--profile: {values['profile']}: {exc}") from exc
    if split is None:
        return values
    filled = {_SPLIT_SETTINGS[k]: v for k, v in split.engine_fields().items() if values.get(_SPLIT_SETTINGS[k]) is None}
    return {**values, **filled}
