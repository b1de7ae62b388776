"""FineMoE's similarity scores (§4.2, §4.4): pairwise cosine between new iterations (rows,
B of them) and stored ones (columns, C of them). Pure tensor functions.

Not to be confused with `elasticmoe.adapters.expert_map` (ESFT rerouting tables).
"""

from __future__ import annotations

import torch

# A zero vector (an empty trajectory) has no direction; its cosine with anything is 0.
_EPS = 1e-12


def cosine_scores(new: torch.Tensor, old: torch.Tensor) -> torch.Tensor:
    """`new` [B, D], `old` [C, D] -> [B, C] with `new_x . old_y / (|new_x| |old_y|)`."""
    if new.dim() != 2 or old.dim() != 2 or new.shape[1] != old.shape[1]:
        raise ValueError(f"cosine: need [B, D] and [C, D], got {tuple(new.shape)} and {tuple(old.shape)}")
    new, old = new.float(), old.float()
    new_unit = new / new.norm(dim=1, keepdim=True).clamp_min(_EPS)
    old_unit = old / old.norm(dim=1, keepdim=True).clamp_min(_EPS)
    return new_unit @ old_unit.T


def semantic_scores(sem_new: torch.Tensor, sem_old: torch.Tensor) -> torch.Tensor:
    """Eq. 4: `score^sem` [B, C] between new semantic embeddings [B, h] and stored ones [C, h]."""
    return cosine_scores(sem_new, sem_old)


def trajectory_scores(map_new: torch.Tensor, map_old: torch.Tensor) -> torch.Tensor:
    """Eq. 5: `score^traj` [B, C] between observed trajectories `map_new` [B, n, E] (the
    gate distributions of the first n layers of each new iteration) and the same n layers of
    the stored maps `map_old` [C, n, E], each flattened to an (n * E)-vector."""
    if map_new.dim() != 3 or map_old.dim() != 3 or map_new.shape[1:] != map_old.shape[1:]:
        raise ValueError(f"trajectory: need [B, n, E] and [C, n, E], got {tuple(map_new.shape)} "
                         f"and {tuple(map_old.shape)}")
    return cosine_scores(map_new.flatten(1), map_old.flatten(1))


def redundancy_scores(sem_new: torch.Tensor, sem_old: torch.Tensor, map_new: torch.Tensor,
                      map_old: torch.Tensor, prefetch_distance: int) -> torch.Tensor:
    """§4.4: `RDY = d/L * score^sem + (L - d)/L * score^traj` [B, C], with the trajectory score
    over whole maps ([B, L, E] vs [C, L, E]): the two searches guide d and L - d layers."""
    num_layers = map_new.shape[1]
    if not 0 <= prefetch_distance <= num_layers:
        raise ValueError(f"redundancy: prefetch distance {prefetch_distance} outside [0, {num_layers}]")
    w_sem = prefetch_distance / num_layers
    return w_sem * semantic_scores(sem_new, sem_old) + (1.0 - w_sem) * trajectory_scores(map_new, map_old)


def best_matches(scores: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row of `scores` [B, C] the stored iteration with the highest score: (index [B],
    score [B]). Ties go to the lowest index. Needs C >= 1."""
    if scores.dim() != 2 or scores.shape[1] == 0:
        raise ValueError(f"best match: need scores [B, C >= 1], got {tuple(scores.shape)}")
    best, index = scores.max(dim=1)
    return index, best
