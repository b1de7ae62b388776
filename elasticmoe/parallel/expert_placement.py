"""Which rank holds which expert, and in which local slot."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class ExpertPlacement:
    """expert -> (rank, local slot). Local slots of a rank are 0..n-1 with no gaps.

    The same placement applies to every MoE layer of the model.
    """

    num_experts: int
    num_ranks: int
    expert_to_rank: tuple[int, ...]
    expert_to_slot: tuple[int, ...]

    def __post_init__(self) -> None:
        if len(self.expert_to_rank) != self.num_experts or len(self.expert_to_slot) != self.num_experts:
            raise ValueError("placement: one rank and one slot per expert")
        for rank in range(self.num_ranks):
            slots = sorted(s for r, s in zip(self.expert_to_rank, self.expert_to_slot, strict=True) if r == rank)
            if slots != list(range(len(slots))):
                raise ValueError(f"placement: local slots of rank {rank} must be 0..n-1, got {slots}")
        if any(not 0 <= r < self.num_ranks for r in self.expert_to_rank):
            raise ValueError("placement: expert assigned to a rank out of range")

    @classmethod
    def balanced(cls, num_experts: int, num_ranks: int) -> ExpertPlacement:
        """Contiguous, as-even-as-possible blocks of experts per rank."""
        if num_ranks < 1 or num_ranks > num_experts:
            raise ValueError(f"ep_size: must be in [1, num_experts={num_experts}], got {num_ranks}")
        base, extra = divmod(num_experts, num_ranks)
        ranks, slots = [], []
        for rank in range(num_ranks):
            for slot in range(base + (rank < extra)):
                ranks.append(rank)
                slots.append(slot)
        return cls(num_experts, num_ranks, tuple(ranks), tuple(slots))

    @classmethod
    def single(cls, num_experts: int) -> ExpertPlacement:
        return cls.balanced(num_experts, 1)

    def local_expert_ids(self, rank: int) -> tuple[int, ...]:
        """Global ids of `rank`'s experts, in local slot order."""
        local = [(s, e) for e, (r, s) in enumerate(zip(self.expert_to_rank, self.expert_to_slot, strict=True)) if r == rank]
        return tuple(e for _, e in sorted(local))
