"""`CoordinatorConfig`: what the elastic server is asked to run, declared and validated once.

It extends the settings both servers share (`ServeSettings`) with the devices, the
first instance's dp, the admission limit, the standby pool and the autoscaler. Its
fields are the flags of `elasticmoe serve`, the `[serve]` and `[autoscale]` tables of
`--config` and the RayService's `serveConfigV2` args (`coordinator.deployment`), all
derived from the declarations here (`elasticmoe.utils.settings`). Built in the driver
(or a test) and shipped to the Serve replica, which builds the HMM and the first
instance from it. Every invalid combination raises naming the option, so the CLI can
exit 2 with a clear message before Ray starts.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Literal

from pydantic import Field, model_validator

from coordinator.autoscaler import AutoscaleConfig
from elasticmoe.adapters.lora_targets import holds_expert_modules
from elasticmoe.config import EngineOptions, ModelConfig
from elasticmoe.entrypoints.serve_settings import ServeSettings, fill_from_profile
from elasticmoe.utils.settings import GIB, cli
from hmm.layout import ModelSizes
from hmm.memory.segments import DEFAULT_PREFIX
from imm.vllm_support import vllm_problem

_DEFAULT_DEVICE_MEMORY = 4 * GIB


class CoordinatorConfig(ServeSettings):
    """Devices, the engine backend, the initial (dp, ep) configuration and the serving limits.

    Invariants: `1 <= dp <= num_devices`; `kv_bytes_per_device < device_memory_bytes`
    (the weights must fit beside the KV pool); `max_queued >= 1`; ep = dp with the native
    backend, ep = 1 (dp replicas, every expert on each) with vLLM, which serves the base model only.
    """

    backend: Literal["native", "vllm"] = Field(
        "native", description="engine of every rank: native (ElasticMoE's engine: expert parallelism across the "
        "dp ranks, ESFT and LoRA adapters, live handover with KV) or vllm (vLLM's CPU build, the optional "
        "`vllm` extra: each of the dp ranks is a replica holding every expert; requests move between "
        "replicas by recomputing their tokens)", json_schema_extra=cli(metavar="B"))
    expert_parallel: bool | None = Field(
        None, description="spread the experts over the dp ranks (EP = DP) instead of a full copy on each; "
        "default: on with --backend native (it always does), off with --backend vllm (its CPU build cannot)")

    num_devices: int = Field(1, description="logical devices to create: one HMM worker process and memory "
                             "budget each", json_schema_extra=cli("--devices", metavar="N"))
    dp: int = Field(1, description="data-parallel ranks of the first instance, 1 <= D <= --devices; expert "
                    "parallelism spans the same D ranks (--backend vllm: D replicas)", json_schema_extra=cli(metavar="D"))
    device_memory_bytes: int = Field(
        _DEFAULT_DEVICE_MEMORY, description="memory budget of each logical device in GiB: weights, KV cache and "
        "scaling headroom (with expert offloading: dense weights, KV cache and the expert cache; the experts "
        "themselves are the node's host tier)", json_schema_extra=cli("--device-memory-gb", metavar="G", unit=GIB))
    expert_tier: Literal["host", "disk"] = Field(
        "host", description="with expert offloading, where the experts a device's cache does not hold are read "
        "from: host (each node keeps its devices' experts in shared memory, one copy per node; a load is a memory "
        "copy) or disk (nowhere but the checkpoint, read with pread through the OS page cache: for experts larger than "
        "the nodes' memory; a scale then moves no expert; ESFT adapters' rows stay in host memory)",
        json_schema_extra=cli(metavar="TIER"))
    max_queued: int = Field(256, description="requests waiting plus in flight; beyond N the server answers 503 "
                            "with Retry-After", json_schema_extra=cli(metavar="N"))
    max_hold_s: float = Field(30.0, description="longest a new request is held at the ingress while no instance "
                              "accepts (a switchover, a repair, a coordinator restart), seconds",
                              json_schema_extra=cli("--max-hold", metavar="S"))
    request_assigning: Literal["coserve", "parallel"] = Field(
        "coserve", description="which rank a request goes to: coserve (the shortest expected finish with the "
        "latency model K*n + B of --profile and adapter switch costs: CoServe §4.2) or parallel (the "
        "least-loaded rank, adapter-unaware)")
    prefix_routing: bool = Field(
        True, description="with prefix caching, send a request to the rank that holds the longest part of its "
        "prompt in its KV cache, as the router remembers it, unless that rank has 4 more requests in flight than the "
        "least-loaded one; --no-prefix-routing leaves the choice to --request-assigning alone")
    standby_pool: bool = Field(True, description="pre-initialise standby instances for dp-1 and dp+1 (paper "
                               "§4.5); --no-standby-pool saves their processes' memory, and each scale then "
                               "boots its target instance, ~2 s slower")
    # NOTE: on CPU "devices" a boot competes with serving for the same cores (accelerator
    # serving would not feel it); 0 refills at once.
    standby_delay_s: float = Field(0.0, description="wait S seconds after a scale before booting the next "
                                   "standby instances (on CPU a boot takes cores from serving)",
                                   json_schema_extra=cli("--standby-delay", metavar="S"))
    idle_rank_processes: int = Field(
        2, ge=0, description="processes of retired ranks kept idle for the next instance on their node (native "
        "backend): a scale that reuses one skips a process start (~3 CPU-s: interpreter, Ray worker, torch); "
        "each idle one holds a few hundred MB. 0: every retired rank's process exits",
        json_schema_extra=cli(metavar="N"))
    max_devices: int | None = Field(
        None, description="most devices a scale may use; the devices missing beyond those the cluster's nodes "
        "offer are asked of Ray's autoscaler (KubeRay adds worker pods) and used once they join. Default: "
        "the devices offered", json_schema_extra=cli(metavar="N"))
    device_wait_s: float = Field(300.0, description="how long a scale waits for devices asked of Ray's "
                                 "autoscaler before it gives up (nothing changes)",
                                 json_schema_extra=cli("--device-wait", metavar="S"))
    release_idle_nodes: bool = Field(False, description="give back a node once the model uses none of its "
                                     "devices (after a scale-down or a drain; never the coordinator's own node): "
                                     "its devices are unregistered, so Ray's autoscaler may remove it")
    shm_prefix: str = Field(DEFAULT_PREFIX, description="name prefix of the HMM's /dev/shm files; give each "
                            "server on one machine its own", json_schema_extra=cli(metavar="PREFIX"))
    autoscale: AutoscaleConfig = AutoscaleConfig()

    @model_validator(mode="before")
    @classmethod
    def _elastic_defaults(cls, values: Any) -> Any:
        """The KV cache per device defaults to min(0.25 GiB, a quarter of the device), after a
        profile's memory split (`fill_from_profile`: it may be the one that sets it)."""
        values = fill_from_profile(values)
        if isinstance(values, dict) and values.get("kv_bytes_per_device") is None:
            memory = values.get("device_memory_bytes", _DEFAULT_DEVICE_MEMORY)
            if isinstance(memory, int) and memory > 0:
                values = {**values, "kv_bytes_per_device": min(GIB // 4, memory // 4)}
        return values

    @model_validator(mode="after")
    def _check_elastic(self) -> CoordinatorConfig:
        if self.num_devices < 1:
            raise ValueError(f"--devices: must be >= 1, got {self.num_devices}")
        if self.dp < 1:
            raise ValueError(f"--dp: must be >= 1, got {self.dp}")
        if self.dp > self.num_devices:
            raise ValueError(f"--dp: {self.dp} ranks need {self.dp} devices, only {self.num_devices} given")
        if self.device_memory_bytes <= 0:
            raise ValueError(f"--device-memory-gb: must be > 0, got {self.device_memory_bytes / GIB:g}")
        assert self.kv_bytes_per_device is not None  # the default is filled in before
        if not 0 < self.kv_bytes_per_device < self.device_memory_bytes:
            raise ValueError(f"--kv-cache-gb: must be > 0 and below --device-memory-gb, "
                             f"got {self.kv_bytes_per_device / GIB:g}")
        if self.max_queued < 1:
            raise ValueError(f"--max-queued: must be >= 1, got {self.max_queued}")
        if not 0 < self.max_hold_s <= 3600:
            raise ValueError(f"--max-hold: must be > 0 and at most 3600 s, got {self.max_hold_s:g}")
        if self.autoscale.min_dp > self.num_devices:
            raise ValueError(f"--autoscale-min-dp: {self.autoscale.min_dp} exceeds the {self.num_devices} devices")
        if self.max_devices is not None and self.max_devices < self.dp:
            raise ValueError(f"--max-devices: must be >= --dp ({self.dp}), got {self.max_devices}")
        if not 0 < self.device_wait_s <= 3600:
            raise ValueError(f"--device-wait: must be > 0 and at most 3600 s, got {self.device_wait_s:g}")
        if not 0 <= self.standby_delay_s <= 3600:
            raise ValueError(f"--standby-delay: must be between 0 and 3600 s, got {self.standby_delay_s}")
        self._check_backend()
        return self

    def _check_backend(self) -> None:
        """Refuse what the chosen backend cannot do, naming the flag (before anything starts)."""
        if self.backend == "native":
            if self.expert_parallel is False:
                raise ValueError("--no-expert-parallel: the native backend always spreads its experts over the dp "
                                 "ranks (replicas holding every expert are --backend vllm's layout)")
            if self.offloads_experts:  # a cache below top-k must stop here, not in a replica at start
                model = ModelConfig.from_pretrained(self.model_dir)
                self.hmm_cache_bytes(ModelSizes.from_model(model, self.torch_dtype.itemsize), model.top_k)
            if self.expert_tier == "disk" and not self.offloads_experts:
                raise ValueError("--expert-tier disk: the disk tier is where an expert cache reads from; give "
                                 "--expert-cache-gb or --expert-cache-fraction")
            if self.expert_page_cache == "drop" and self.expert_tier != "disk":  # without a cache: refused above
                raise ValueError("--expert-page-cache drop: the elastic server's caches read the host tier (shared "
                                 "memory, no page cache); give --expert-tier disk to read the checkpoint")
            return
        if self.expert_parallel:
            raise ValueError("--expert-parallel: vLLM's CPU build cannot run expert parallelism across ranks (its "
                             "CPU communicator has no all_gatherv); with --backend vllm each of the --dp ranks is "
                             "a replica holding every expert")
        if self.esft_adapters:
            raise ValueError("--esft-adapter: ESFT adapters need --backend native (vLLM serves the base model)")
        if self.max_loras or self.lora_adapters:
            raise ValueError("--max-loras: LoRA adapters need --backend native (vLLM serves the base model)")
        if self.offloads_experts:
            raise ValueError("--expert-cache-gb: expert offloading needs --backend native")
        problem = vllm_problem(self.model_dir)
        if problem is not None:
            raise ValueError(f"--backend vllm: {problem}")

    @property
    def is_expert_parallel(self) -> bool:
        """ep = dp (experts spread over the ranks) rather than ep = 1 (a full replica per rank)."""
        return self.expert_parallel if self.expert_parallel is not None else self.backend == "native"

    @property
    def rank_local_lora_slots(self) -> int:
        """The LoRA slots of each rank when the ranks swap their own (one rank's engine without EP, or
        slots of attention modules only: `engine.adapter_manager`), so that they hold different
        adapters; 0 when the ranks hold the same ones (slots on the experts, swapped in lockstep)."""
        if not self.max_loras or (self.is_expert_parallel and holds_expert_modules(self.lora_target_modules)):
            return 0
        return self.max_loras

    @property
    def hmm_kv_bytes(self) -> int:
        """The HMM's KV pool per device: the native engine's paged KV cache; none with vLLM, which
        allocates its own (`kv_bytes_per_device` of it, in the rank's process)."""
        assert self.kv_bytes_per_device is not None  # the default is filled in before
        return self.kv_bytes_per_device if self.backend == "native" else 0

    def hmm_cache_bytes(self, sizes: ModelSizes, top_k: int) -> int | None:
        """Each device's expert cache pool when the experts are offloaded (None: they are resident):
        `--expert-cache-gb`, or `--expert-cache-fraction` of a device's experts at the first
        instance's dp. Every device keeps this size through scales, so a scale-down offloads
        more experts instead of needing more memory; `ValueError` naming the flag below top-k."""
        if not self.offloads_experts:
            return None
        per_device = -(-sizes.num_experts // self.dp)
        pool = sizes.cache_pool_bytes(per_device, self.expert_cache_bytes, self.expert_cache_fraction)
        rows = pool // sizes.cache_row_bytes
        if rows < top_k:
            flag = ("--expert-cache-gb" if self.expert_cache_bytes is not None else "--expert-cache-fraction")
            raise ValueError(f"{flag}: a device's expert cache holds {rows} experts; a token is routed to {top_k} "
                             f"experts per layer, so it needs at least {top_k} ({top_k * sizes.cache_row_bytes} B)")
        return pool

    @property
    def esft_slots(self) -> tuple[int, int]:
        """(N, E_max) of the ESFT adapter slots; (0, 0) without any (always with vLLM)."""
        return super().esft_slots if self.backend == "native" else (0, 0)

    def engine_options(self) -> EngineOptions:
        """What every rank's `EngineConfig` gets (its KV pool is its device's, from the HMM)."""
        # NOTE: every rank keeps every registered LoRA adapter in host memory (--max-cpu-loras) and
        # the slots hold the hot set; under EP the ranks swap in lockstep (`engine.lora_lockstep`).
        kv = None if self.backend == "native" else self.kv_bytes_per_device  # vLLM sizes its own KV cache
        return dataclasses.replace(super().engine_options(), kv_cache_bytes=kv, num_threads=self.num_threads or 1,
                                   expert_tier=self.expert_tier)

    @property
    def device_limit(self) -> int:
        """The most devices a scale may use (what the autoscaler's max dp is bounded by)."""
        return max(self.num_devices, self.max_devices or 0)
