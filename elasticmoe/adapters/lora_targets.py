"""The module names LoRA slots may be restricted to (`--lora-target-modules`), importable without
torch: the settings check them before anything starts.

Names are PEFT's `target_modules` names. Which of them a model has depends on its attention (GQA:
q/k/v/o; DeepSeek-V2's MLA: q or q_a and q_b, kv_a_proj_with_mqa, o) and on whether it has MoE
blocks (the experts' gate/up/down, named w1/w3/w2 in Mixtral): `served_modules`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from elasticmoe.config import ModelConfig

ATTENTION_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "q_a_proj", "q_b_proj", "kv_a_proj_with_mqa")
# expert module name -> the part of the expert it adapts
EXPERT_PARTS = {"gate_proj": "gate", "w1": "gate", "up_proj": "up", "w3": "up", "down_proj": "down", "w2": "down"}
EXPERT_MODULES = tuple(EXPERT_PARTS)
TARGET_MODULES = ATTENTION_MODULES + EXPERT_MODULES


def holds_expert_modules(targets: tuple[str, ...] | frozenset[str] | None) -> bool:
    """Whether slots of `targets` (None: every module) hold sites on the experts. Under expert
    parallelism such a slot serves every rank's tokens, so the ranks swap it together; slots of
    attention modules only serve their own rank's tokens, and each rank swaps its own."""
    return targets is None or any(t in EXPERT_PARTS for t in targets)


def parse_target_modules(value: object, option: str = "lora_target_modules") -> tuple[str, ...] | None:
    """"q_proj,v_proj" (a flag), a list of names (a file, Serve args) or None (every module) -> the
    names; `ValueError` naming `option` unless they are known, at least one, each once."""
    if value is None:
        return None
    if isinstance(value, str):
        names = tuple(n.strip() for n in value.split(",") if n.strip())
    elif isinstance(value, (list, tuple)) and all(isinstance(n, str) for n in value):
        names = tuple(value)
    else:
        raise ValueError(f"{option}: want module names, got {value!r}")
    unknown = sorted(set(names) - set(TARGET_MODULES))
    if unknown or not names or len(set(names)) != len(names):
        raise ValueError(f"{option}: want distinct names among {', '.join(TARGET_MODULES)}; "
                         f"got {', '.join(names) or 'none'}")
    return names


def served_modules(config: ModelConfig) -> tuple[str, ...]:
    """The module names a model of `config` can have LoRA slots for, in `TARGET_MODULES` order."""
    if config.is_mla:
        names = {"q_a_proj", "q_b_proj"} if config.q_lora_rank is not None else {"q_proj"}
        names |= {"kv_a_proj_with_mqa", "o_proj"}
    else:
        names = {"q_proj", "k_proj", "v_proj", "o_proj"}
    if config.moe_layer_ids:
        names |= set(EXPERT_MODULES)
    return tuple(n for n in TARGET_MODULES if n in names)


def check_served(targets: tuple[str, ...] | None, config: ModelConfig, option: str = "lora_target_modules") -> None:
    """`ValueError` naming `option` if a model of `config` has none of some of `targets`."""
    served = served_modules(config)
    missing = [name for name in targets or () if name not in served]
    if missing:
        raise ValueError(f"{option}: this model has no {', '.join(missing)} (its LoRA targets: {', '.join(served)})")
