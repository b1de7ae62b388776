"""The offline profile (CoServe §4.5): per adapter kind, the performance matrix the online
policies use, plus usage probabilities and the memory split found from them (§4.4).

Per kind ("base", "lora", "esft", "expert"; CoServe: "experts of the same model architecture
are profiled only once", and every LoRA slot has the same padded shape):

- `max_batch`: where the average latency per request stops falling (request splitting, §4.2;
  the memory split under limited computation, §4.4);
- `k_s`, `b_s`: a batch of n requests of one adapter takes `K * n + B` seconds (§4.2);
- `load_s`: seconds to switch one item of the kind into the tier (the switch latency, §4.2);
- `footprint_bytes`: device bytes of one item (one LoRA slot, one ESFT adapter's rows, one
  expert's rows; §4.3's memory score).

A profile is a frozen value with a JSON form (`to_json` / `from_json`, `save` / `load_profile`);
`elasticmoe.bench.adapter_profile.write_profile` measures one on a real engine.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from elasticmoe.adapter_policy.usage import check_probability

PROFILE_VERSION = 1
BASE_KIND = "base"


@dataclass(frozen=True, slots=True)
class KindProfile:
    """The performance matrix of one adapter kind on one device (see the module docstring)."""

    max_batch: int
    k_s: float
    b_s: float
    load_s: float = 0.0
    footprint_bytes: int = 0

    def __post_init__(self) -> None:
        if self.max_batch < 1:
            raise ValueError(f"max_batch: must be >= 1, got {self.max_batch}")
        for name in ("k_s", "b_s", "load_s"):
            value = getattr(self, name)
            if not math.isfinite(value) or value < 0:
                raise ValueError(f"{name}: must be a finite number >= 0, got {value}")
        if self.footprint_bytes < 0:
            raise ValueError(f"footprint_bytes: must be >= 0, got {self.footprint_bytes}")

    def batch_latency(self, num_requests: int) -> float:
        """K * n + B seconds for one batch of `num_requests` (>= 1) requests of one adapter."""
        return self.k_s * num_requests + self.b_s

    def to_json(self) -> dict[str, Any]:
        return {"max_batch": self.max_batch, "k_s": self.k_s, "b_s": self.b_s, "load_s": self.load_s,
                "footprint_bytes": self.footprint_bytes}

    @classmethod
    def from_json(cls, obj: Mapping[str, Any]) -> KindProfile:
        return cls(int(obj["max_batch"]), float(obj["k_s"]), float(obj["b_s"]), float(obj.get("load_s", 0.0)),
                   int(obj.get("footprint_bytes", 0)))


@dataclass(frozen=True, slots=True)
class MemorySplit:
    """How a device's memory budget divides (CoServe §4.4): KV cache for batch inference, LoRA
    slots, ESFT slots (`esft_bytes` for `num_esft_slots` adapters' rows) and the expert cache
    (with offloading).

    Invariant: the four parts are >= 0 and sum to at most `budget_bytes`.
    """

    budget_bytes: int
    kv_cache_bytes: int
    num_lora_slots: int
    lora_slot_bytes: int
    num_expert_rows: int = 0
    expert_row_bytes: int = 0
    esft_bytes: int = 0
    max_num_seqs: int = 1  # min(profiled max batch, requests the KV cache holds): request splitting
    strategy: str = "decay_window"  # or "limited" (the max batch's KV is small, §4.4)
    window: tuple[int, int] | None = None  # the decay window the search stopped in (items loaded)
    num_esft_slots: int = 0  # ESFT adapters resident at once (--max-esft-adapters); 0: not set by the split
    # The modules the LoRA slots hold, which `lora_slot_bytes` is the size of (None: every module)
    lora_target_modules: tuple[str, ...] | None = None

    def __post_init__(self) -> None:
        parts = (self.kv_cache_bytes, self.num_lora_slots, self.lora_slot_bytes, self.num_expert_rows,
                 self.expert_row_bytes, self.esft_bytes, self.num_esft_slots)
        if min(parts) < 0 or self.max_num_seqs < 1:
            raise ValueError(f"memory split: negative part or max_num_seqs < 1: {self}")
        if self.used_bytes > self.budget_bytes:
            raise ValueError(f"memory split: parts need {self.used_bytes} bytes > budget {self.budget_bytes}")
        if self.strategy not in ("decay_window", "limited"):
            raise ValueError(f"memory split: strategy {self.strategy!r} is not decay_window or limited")

    @property
    def lora_bytes(self) -> int:
        return self.num_lora_slots * self.lora_slot_bytes

    @property
    def expert_cache_bytes(self) -> int:
        return self.num_expert_rows * self.expert_row_bytes

    @property
    def used_bytes(self) -> int:
        return self.kv_cache_bytes + self.lora_bytes + self.expert_cache_bytes + self.esft_bytes

    def engine_fields(self) -> dict[str, Any]:
        """The `EngineOptions` fields this split sets (`serve --profile`)."""
        out: dict[str, Any] = {"kv_cache_bytes": self.kv_cache_bytes, "max_num_seqs": self.max_num_seqs}
        if self.num_lora_slots:
            out["max_loras"] = self.num_lora_slots
        if self.num_esft_slots:
            out["max_esft_adapters"] = self.num_esft_slots
        if self.num_lora_slots and self.lora_target_modules is not None:
            out["lora_target_modules"] = self.lora_target_modules
        return out

    def to_json(self) -> dict[str, Any]:
        return {"budget_bytes": self.budget_bytes, "kv_cache_bytes": self.kv_cache_bytes,
                "num_lora_slots": self.num_lora_slots, "lora_slot_bytes": self.lora_slot_bytes,
                "num_expert_rows": self.num_expert_rows, "expert_row_bytes": self.expert_row_bytes,
                "esft_bytes": self.esft_bytes, "num_esft_slots": self.num_esft_slots,
                "max_num_seqs": self.max_num_seqs, "strategy": self.strategy,
                "window": list(self.window) if self.window is not None else None,
                "lora_target_modules": list(self.lora_target_modules) if self.lora_target_modules is not None else None}

    @classmethod
    def from_json(cls, obj: Mapping[str, Any]) -> MemorySplit:
        window, targets = obj.get("window"), obj.get("lora_target_modules")
        return cls(int(obj["budget_bytes"]), int(obj["kv_cache_bytes"]), int(obj["num_lora_slots"]),
                   int(obj["lora_slot_bytes"]), int(obj.get("num_expert_rows", 0)),
                   int(obj.get("expert_row_bytes", 0)), int(obj.get("esft_bytes", 0)),
                   int(obj.get("max_num_seqs", 1)), str(obj.get("strategy", "decay_window")),
                   (int(window[0]), int(window[1])) if window is not None else None,
                   int(obj.get("num_esft_slots", 0)),
                   tuple(str(name) for name in targets) if targets is not None else None)


@dataclass(frozen=True, slots=True)
class Profile:
    """One device's profile of one base model (see the module docstring).

    Invariants: a "base" kind exists; every adapter's kind (`adapter_kind`) is profiled;
    usage probabilities are in [0, 1].
    """

    model: str
    device: str
    kinds: Mapping[str, KindProfile]
    kv_bytes_per_token: int
    tokens_per_request: int  # prompt + output tokens of a typical request: sizes its KV
    usage_probability: Mapping[str, float] = field(default_factory=dict)  # adapter -> probability
    adapter_kind: Mapping[str, str] = field(default_factory=dict)  # adapter -> kind
    memory_split: MemorySplit | None = None
    meta: Mapping[str, Any] = field(default_factory=dict)  # when, torch version, sample sizes...

    def __post_init__(self) -> None:
        if BASE_KIND not in self.kinds:
            raise ValueError(f"profile: kinds must include {BASE_KIND!r}, got {sorted(self.kinds)}")
        if self.kv_bytes_per_token < 1 or self.tokens_per_request < 1:
            raise ValueError("profile: kv_bytes_per_token and tokens_per_request must be >= 1")
        missing = sorted({k for k in self.adapter_kind.values() if k not in self.kinds})
        if missing:
            raise ValueError(f"profile: adapter kinds {missing} are not profiled")
        for name, p in self.usage_probability.items():
            check_probability(p, f"profile usage_probability of {name!r}")

    @property
    def request_kv_bytes(self) -> int:
        """KV bytes one typical request holds."""
        return self.kv_bytes_per_token * self.tokens_per_request

    def kind_of(self, adapter: str | None, default: str = "lora") -> str:
        if adapter is None:
            return BASE_KIND
        return self.adapter_kind.get(adapter, default)

    def to_json(self) -> dict[str, Any]:
        return {
            "version": PROFILE_VERSION, "model": self.model, "device": self.device,
            "kinds": {k: v.to_json() for k, v in sorted(self.kinds.items())},
            "kv_bytes_per_token": self.kv_bytes_per_token, "tokens_per_request": self.tokens_per_request,
            "usage_probability": dict(sorted(self.usage_probability.items())),
            "adapter_kind": dict(sorted(self.adapter_kind.items())),
            "memory_split": self.memory_split.to_json() if self.memory_split is not None else None,
            "meta": dict(self.meta),
        }

    @classmethod
    def from_json(cls, obj: Mapping[str, Any]) -> Profile:
        """Parse `to_json`'s form; `ValueError` naming what is wrong."""
        try:
            if obj.get("version") != PROFILE_VERSION:
                raise ValueError(f"version: expected {PROFILE_VERSION}, got {obj.get('version')!r}")
            split = obj.get("memory_split")
            return cls(
                model=str(obj["model"]), device=str(obj["device"]),
                kinds={str(k): KindProfile.from_json(v) for k, v in obj["kinds"].items()},
                kv_bytes_per_token=int(obj["kv_bytes_per_token"]),
                tokens_per_request=int(obj["tokens_per_request"]),
                usage_probability={str(k): float(v) for k, v in obj.get("usage_probability", {}).items()},
                adapter_kind={str(k): str(v) for k, v in obj.get("adapter_kind", {}).items()},
                memory_split=MemorySplit.from_json(split) if split is not None else None,
                meta=dict(obj.get("meta", {})),
            )
        except (KeyError, TypeError, AttributeError) as exc:
            raise ValueError(f"profile: malformed ({exc!r})") from exc

    def save(self, path: str | Path) -> Path:
        out = Path(path)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(self.to_json(), indent=2) + "\n")
        return out


def load_profile(path: str | Path) -> Profile:
    """Read a profile JSON file (`Profile.save`, `elasticmoe profile`); `ValueError` naming `path`
    if it is not one."""
    try:
        obj = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"profile: cannot read {path}: {exc}") from exc
    if not isinstance(obj, dict):
        raise ValueError(f"profile: {path} does not hold a JSON object")
    try:
        return Profile.from_json(obj)
    except ValueError as exc:
        raise ValueError(f"profile: {path}: {exc}") from exc
