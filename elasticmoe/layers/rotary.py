"""Rotary position embeddings, precomputed once per model.

Two conventions exist in the supported checkpoints: Qwen3/Mixtral rotate the
two halves of the head (`rotate_half`); DeepSeek-V2 rotates interleaved pairs.
"""

from __future__ import annotations

import torch


class RotaryEmbedding:
    def __init__(self, dim: int, max_positions: int, theta: float, interleaved: bool) -> None:
        inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
        freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq)  # [P, dim/2]
        self.cos = freqs.cos()
        self.sin = freqs.sin()
        self.interleaved = interleaved
        self.max_positions = max_positions

    def __call__(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """x: [T, heads, dim] -> rotated copy, computed in float32 and cast back."""
        cos = self.cos[positions].unsqueeze(1)  # [T, 1, dim/2]
        sin = self.sin[positions].unsqueeze(1)
        xf = x.float()
        if self.interleaved:
            x1, x2 = xf[..., 0::2], xf[..., 1::2]
            out = torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).flatten(-2)
        else:
            x1, x2 = xf.chunk(2, dim=-1)
            out = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
        return out.to(x.dtype)
