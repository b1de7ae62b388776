"""`CoordinatorConfig`: what the elastic server is asked to run, validated once.

Built by `elasticmoe serve` (or a test) in the driver and shipped to the Serve
replica, which builds the HMM and the first instance from it. Every invalid
combination raises `ValueError` naming the option, so the CLI can exit 2 with a
clear message before Ray starts.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import torch

from coordinator.autoscaler import AutoscaleConfig
from elasticmoe.entrypoints.openai.access import AccessPolicy
from hmm.memory.shm import DEFAULT_PREFIX

_GIB = 1 << 30
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@dataclasses.dataclass(frozen=True, slots=True)
class CoordinatorConfig:
    """Devices, the initial (dp, ep=dp) configuration and the serving limits.

    Invariants: `1 <= dp <= num_devices`; `kv_bytes_per_device < device_memory_bytes`
    (the weights must fit beside the KV pool); `max_queued >= 1`.
    """

    model_dir: str
    num_devices: int
    dp: int
    dtype: str = "float32"
    device_memory_bytes: int = 4 * _GIB
    kv_bytes_per_device: int = 256 << 20
    max_queued: int = 256  # requests waiting + in flight; one more gets a 503
    served_model_name: str | None = None
    num_threads: int = 1  # torch threads per rank (ranks share the node's cores)
    shm_prefix: str = DEFAULT_PREFIX  # names of the HMM's /dev/shm files (tests use a unique one)
    max_hold_s: float = 30.0  # longest a request waits at the router's gate during a switchover
    standby_pool: bool = True  # pre-initialise standby instances for dp-1 and dp+1 (paper §4.5)
    # Seconds after a scale before the pool is refilled: on CPU "devices" a boot competes with
    # serving for the same cores (accelerator serving would not feel it); 0 refills at once.
    standby_delay_s: float = 0.0
    max_esft_adapters: int = 4  # ESFT adapter slots (0: none); address space only until loaded
    max_esft_experts: int = 16  # E_max: most experts one adapter tunes in one layer
    esft_adapters: tuple[tuple[str, str], ...] = ()  # (name, path) loaded at start
    max_loras: int = 0  # LoRA slots per rank (0: no LoRA); under EP every loaded adapter is resident
    max_lora_rank: int = 16
    lora_adapters: tuple[tuple[str, str], ...] = ()  # (name, path) loaded at start
    max_model_len: int | None = None  # None: the model's (the KV pool may lower it)
    max_num_batched_tokens: int | None = None  # None: the engine's default
    max_num_seqs: int | None = None  # requests one rank runs at once; None: the engine's default
    autoscale: AutoscaleConfig = AutoscaleConfig()  # its SLO targets feed /metrics even when off
    access: AccessPolicy = AccessPolicy()  # API keys and request size limits (keys never in repr)
    shutdown_timeout_s: float = 30.0  # SIGTERM / POST /admin/drain: longest wait for requests in flight

    def __post_init__(self) -> None:
        if self.num_devices < 1:
            raise ValueError(f"--devices: must be >= 1, got {self.num_devices}")
        if self.dp < 1:
            raise ValueError(f"--dp: must be >= 1, got {self.dp}")
        if self.dp > self.num_devices:
            raise ValueError(f"--dp: {self.dp} ranks need {self.dp} devices, only {self.num_devices} given")
        if self.dtype not in _DTYPES:
            raise ValueError(f"--dtype: must be one of {sorted(_DTYPES)}, got {self.dtype!r}")
        if self.device_memory_bytes <= 0:
            raise ValueError(f"--device-memory-gb: must be > 0, got {self.device_memory_bytes / _GIB:g}")
        if not 0 < self.kv_bytes_per_device < self.device_memory_bytes:
            raise ValueError(
                f"--kv-cache-gb: must be > 0 and below --device-memory-gb, "
                f"got {self.kv_bytes_per_device / _GIB:g}"
            )
        if self.max_queued < 1:
            raise ValueError(f"--max-queued: must be >= 1, got {self.max_queued}")
        for name in ("max_model_len", "max_num_batched_tokens", "max_num_seqs"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"--{name.replace('_', '-')}: must be >= 1, got {value}")
        if self.max_esft_adapters < 0 or self.max_esft_experts < 1:
            raise ValueError("--max-esft-adapters: must be >= 0 and --max-esft-experts >= 1")
        if len(self.esft_adapters) > self.max_esft_adapters:
            raise ValueError(
                f"--max-esft-adapters: {self.max_esft_adapters} slots for {len(self.esft_adapters)} --esft-adapter"
            )
        if self.max_loras < 0 or self.max_lora_rank < 1 or len(self.lora_adapters) > self.max_loras:
            raise ValueError("--max-loras: must be >= 0 and hold every --lora-adapter; --max-lora-rank >= 1")
        if self.autoscale.min_dp > self.num_devices:
            raise ValueError(f"--autoscale-min-dp: {self.autoscale.min_dp} exceeds the {self.num_devices} devices")
        if not 0 <= self.standby_delay_s <= 3600:
            raise ValueError(f"--standby-delay: must be between 0 and 3600 s, got {self.standby_delay_s}")
        if not 0 <= self.shutdown_timeout_s <= 3600:
            raise ValueError(f"--shutdown-timeout: must be between 0 and 3600 s, got {self.shutdown_timeout_s}")
        if self.num_threads < 1:
            raise ValueError(f"num_threads: must be >= 1, got {self.num_threads}")
        if not (Path(self.model_dir) / "config.json").is_file():
            raise ValueError(f"--model: {self.model_dir} has no config.json")

    @property
    def esft_slots(self) -> tuple[int, int]:
        """(N, E_max) for the HMM's virtual weight tensors."""
        return (self.max_esft_adapters, self.max_esft_experts) if self.max_esft_adapters else (0, 0)

    @property
    def torch_dtype(self) -> torch.dtype:
        return _DTYPES[self.dtype]

    @property
    def model_name(self) -> str:
        """The name clients pass as `model`."""
        return self.served_model_name or Path(self.model_dir).resolve().name

    def engine_options(self) -> dict[str, Any]:
        """Options every rank's `EngineConfig` gets (the KV pool size comes from the HMM)."""
        options: dict[str, Any] = {"dtype": self.torch_dtype, "num_threads": self.num_threads}
        if self.max_esft_adapters:
            options.update(max_esft_adapters=self.max_esft_adapters, max_esft_experts=self.max_esft_experts)
        if self.max_loras:
            # NOTE: an instance of any dp may take over (dp 1 could swap through a host cache; the
            # others cannot): keep every loaded adapter resident, the same in every instance.
            options.update(max_loras=self.max_loras, max_lora_rank=self.max_lora_rank,
                           max_cpu_loras=self.max_loras)
        if self.max_model_len is not None:
            options["max_model_len"] = self.max_model_len
        if self.max_num_batched_tokens is not None:
            options["max_num_batched_tokens"] = self.max_num_batched_tokens
        if self.max_num_seqs is not None:
            options["max_num_seqs"] = self.max_num_seqs
        return options


def gib_to_bytes(gib: float) -> int:
    return int(gib * _GIB)
