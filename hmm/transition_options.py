"""`TransitionOptions`: which HMM mechanisms a scaling transition may use.

ElasticMoE's transition (all options on) reuses kept tensors in place, remaps
kept experts page-wise and fills the rest by p2p. The paper's baselines and
ablations (Table 1, §7.2) switch parts of that off; the planner and the device
workers read the same options, so a plan and its execution always agree:

- `zero_copy=False`: the target gets its own new buffers for everything it holds
  on every device (dense tensors, expert stacks and a new KV pool); the old ones
  live until commit, so a kept device holds two copies during the transition.
- `paged_remap=False`: no page-wise expert remapping; on a device whose expert
  list changes, each stacked expert tensor is allocated anew and its kept experts
  are copied device-internally. A stack whose expert list is unchanged is reused.
- `p2p=False`: a device fills what it lacks from disk instead of from a peer.

Baselines, roughly: cold restart = `HMMController.unload` + `load`; extravagant =
a target on fresh devices with `p2p=False`; concurrent = `zero_copy=False,
p2p=False` (a second instance loaded from disk next to the old one).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class TransitionOptions:
    """Mechanisms a transition may use (all on: ElasticMoE's minimal transition)."""

    zero_copy: bool = True
    paged_remap: bool = True
    p2p: bool = True

    @property
    def is_default(self) -> bool:
        """All mechanisms on: plans are minimal (`ScalePlan.validate(minimal=True)`)."""
        return self.zero_copy and self.paged_remap and self.p2p


# ElasticMoE's own transition; the default of every `options` parameter.
DEFAULT_OPTIONS = TransitionOptions()
