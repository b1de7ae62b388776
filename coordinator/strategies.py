"""Scale strategies: ElasticMoE's own, the paper's baselines (§7.2) and its ablations (Table 1).

All run through the same `Scaler` so that their figures are comparable; a strategy
is a set of switches, not a separate code path:

- `transition`: which HMM mechanisms the memory transition may use (zero-copy reuse
  of kept tensors, page-wise remapping of kept experts, device-to-device copies);
- `preinit`: take the target instance from the standby pool (booted before the scale)
  instead of booting it during the scale;
- `placement`: where the target lives and when the old instance stops:
  `in_place` (the target reuses the current devices; the old one serves until the
  switchover), `fresh_devices` (the target on devices the old one does not use; needs
  from_dp + to_dp devices), `stop_first` (the old instance is torn down and the
  model reloaded from disk before the new one starts: downtime by design).

Requests in flight are never dropped: at the switchover they are handed over, with
their KV blocks when the target shares the old KV pool (zero-copy, same device) and
by recomputation otherwise (this makes the baselines *kinder* than a real restart,
which would fail them).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from hmm.transition_options import TransitionOptions

Placement = Literal["in_place", "fresh_devices", "stop_first"]


@dataclass(frozen=True, slots=True)
class ScaleStrategy:
    name: str
    summary: str
    transition: TransitionOptions
    preinit: bool
    placement: Placement = "in_place"

    @property
    def hands_over_kv(self) -> bool:
        """The new instance continues requests on the old KV pool (no recomputation)."""
        return self.placement == "in_place" and self.transition.zero_copy


_ALL_OFF = TransitionOptions(zero_copy=False, paged_remap=False, p2p=False)

STRATEGIES: dict[str, ScaleStrategy] = {
    s.name: s
    for s in (
        ScaleStrategy(
            "elastic",
            "ElasticMoE: zero-copy reuse, page remapping, p2p, pre-initialised standby, KV handover",
            TransitionOptions(),
            preinit=True,
        ),
        ScaleStrategy(
            "cold_restart",
            "Vertical (cold restart): stop the old instance, reload the model from disk, start the new one",
            _ALL_OFF,
            preinit=False,
            placement="stop_first",
        ),
        ScaleStrategy(
            "extravagant",
            "Vertical (extravagant): new instance on fresh devices, loaded from disk, then switch",
            _ALL_OFF,
            preinit=False,
            placement="fresh_devices",
        ),
        ScaleStrategy(
            "concurrent",
            "Vertical (concurrent): co-located new instance loading its own copy from disk, then switch",
            _ALL_OFF,
            preinit=False,
        ),
        # Table 1: each ablation also disables everything above it (cumulative).
        ScaleStrategy(
            "no_ipc_alloc",
            "ablation: no paged (IPC-safe) expert allocation; changed expert stacks are reallocated + copied",
            TransitionOptions(paged_remap=False),
            preinit=True,
        ),
        ScaleStrategy(
            "no_p2p",
            "ablation: as no_ipc_alloc, and tensors a device lacks are read from disk instead of p2p",
            TransitionOptions(paged_remap=False, p2p=False),
            preinit=True,
        ),
        ScaleStrategy(
            "no_preinit",
            "ablation: as no_p2p, and the target instance boots during the scale",
            TransitionOptions(paged_remap=False, p2p=False),
            preinit=False,
        ),
        ScaleStrategy(
            "no_zero_copy",
            "ablation: as no_preinit, and the target gets its own copy of weights and KV (recompute)",
            _ALL_OFF,
            preinit=False,
        ),
    )
}
DEFAULT_STRATEGY = "elastic"
BASELINES = ("elastic", "cold_restart", "extravagant", "concurrent")
ABLATIONS = ("elastic", "no_ipc_alloc", "no_p2p", "no_preinit", "no_zero_copy")


def strategy(name: str) -> ScaleStrategy:
    """The named strategy; `ValueError` naming "strategy" otherwise."""
    try:
        return STRATEGIES[name]
    except (KeyError, TypeError):
        raise ValueError(f"strategy: must be one of {sorted(STRATEGIES)}, got {name!r}") from None
