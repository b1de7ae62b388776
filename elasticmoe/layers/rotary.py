"""Rotary position embeddings, precomputed once per model.

Two conventions exist in the supported checkpoints: Qwen3/Mixtral rotate the
two halves of the head (`rotate_half`) in the model dtype, as HF does;
DeepSeek-V2 rotates interleaved pairs in float32.
"""

from __future__ import annotations

import torch

from elasticmoe.kernels.rotary import fused_rotary


class RotaryEmbedding:
    def __init__(self, dim: int, max_positions: int, theta: float, interleaved: bool) -> None:
        inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
        freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq)  # [P, dim/2]
        self.interleaved = interleaved
        self.max_positions = max_positions
        if interleaved:
            self.cos, self.sin = freqs.cos(), freqs.sin()  # [P, dim/2]
        else:
            # Full width, with rotate_half's sign folded into sin: x * cos + roll(x, dim/2) * sin.
            self.cos = torch.cat((freqs.cos(), freqs.cos()), dim=-1)  # [P, dim]
            self.sin = torch.cat((-freqs.sin(), freqs.sin()), dim=-1)
        self._tables: dict[torch.dtype, torch.Tensor] = {}
        self._last: tuple[torch.Tensor, torch.dtype, torch.Tensor, torch.Tensor] | None = None

    def _cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [T, 1, dim or dim/2] for `positions` [T], in `dtype`.

        Every layer of a step passes the same positions tensor, so the gather runs
        once per step; holding a reference to it keeps the identity test sound.
        """
        last = self._last
        if last is not None and last[0] is positions and last[1] == dtype:
            return last[2], last[3]
        cos, sin = self._table(dtype).index_select(1, positions).unsqueeze(2)  # [T, 1, dim] each
        self._last = (positions, dtype, cos, sin)
        return cos, sin

    def _table(self, dtype: torch.dtype) -> torch.Tensor:
        """[2, P, dim] cos and sin of the half rotation in `dtype`, made once."""
        if dtype not in self._tables:
            self._tables[dtype] = torch.stack((self.cos, self.sin)).to(dtype)
        return self._tables[dtype]

    def __call__(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """x: [T, heads, dim] -> rotated copy in x's dtype."""
        if self.interleaved:
            fused = fused_rotary(x, positions, self.cos, self.sin, interleaved=True)
        else:
            table = self._table(x.dtype)
            fused = fused_rotary(x, positions, table[0], table[1], interleaved=False)
        if fused is not None:
            return fused
        if self.interleaved:
            cos, sin = self._cos_sin(positions, torch.float32)
            xf = x.float()
            x1, x2 = xf[..., 0::2], xf[..., 1::2]
            out = torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).flatten(-2)
            return out.to(x.dtype)
        cos, sin = self._cos_sin(positions, x.dtype)
        return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * sin
