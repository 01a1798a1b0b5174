"""Random (never zero) KDA decode inputs and pools for the kernel tests."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class KdaCase:
    heads: int = 2
    dim: int = 16
    width: int = 4
    num_slots: int = 7

    def params(self, gen: torch.Generator) -> tuple[torch.Tensor, ...]:
        """(conv_weight [3, H*D, W], A_log [H], dt_bias [H*D], norm_weight [D])."""
        h, d, w = self.heads, self.dim, self.width
        return (torch.randn(3, h * d, w, generator=gen) * 0.5, torch.randn(h, generator=gen) * 0.3,
                torch.randn(h * d, generator=gen), torch.rand(d, generator=gen) + 0.5)

    def pools(self, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        """(state_pool [S, H, D, D] float32, conv_pool [S, 3, H, D, W-1])."""
        h, d = self.heads, self.dim
        return (torch.randn(self.num_slots, h, d, d, generator=gen) * 0.1,
                torch.randn(self.num_slots, 3, h, d, self.width - 1, generator=gen))

    def tokens(self, gen: torch.Generator, batch: int, length: int) -> tuple[torch.Tensor, ...]:
        """(q, k, v, z, beta, gate): [B, L, H, D] each, beta [B, L, H]."""
        shape = (batch, length, self.heads, self.dim)
        q, k, v, z, gate = (torch.randn(shape, generator=gen) for _ in range(5))
        return q, k, v, z, torch.randn(batch, length, self.heads, generator=gen), gate
