"""Block AttnRes sites and the depth stream that replaces the residual (K3 report eq.8-10).

A site (before each attention, before each MLP, and once at the output) owns a pseudo-query `query` and
the RMSNorm `norm` applied to its keys. `AttnResStream` holds the completed block sums b_0..b_{n-1}
(b_0 = the embedding) and the running partial sum of the current block; a block is
`attn_res_block_size` decoder layers, each adding its attention and its MLP output to the partial sum.
"""

from __future__ import annotations

import torch
from torch import nn

from k3core.layers.norm import RMSNorm
from k3core.ops.attnres import OnlineSoftmax, attnres_direct, attnres_inter, attnres_merge


class AttnResSite(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.query = nn.Parameter(torch.zeros(dim))
        self.norm = RMSNorm(dim, eps)


class AttnResStream:
    """The inputs of every site of one forward. `two_phase` selects the inference form (inter-block
    statistics once per block, merged with the partial sum by online softmax) over the direct eq.9."""

    def __init__(self, embedding: torch.Tensor, eps: float, two_phase: bool = True) -> None:
        self.blocks = [embedding]
        self.partial: torch.Tensor | None = None
        self.eps = eps
        self.two_phase = two_phase
        self._inter: OnlineSoftmax | None = None
        self._sites: list[AttnResSite] = []

    def begin_block(self, sites: list[AttnResSite]) -> None:
        """Phase 1 for all sites of the block starting now (their queries meet the same block sums)."""
        self._sites = sites
        if self.two_phase:
            queries = torch.stack([s.query for s in sites])
            norms = torch.stack([s.norm.weight for s in sites])
            self._inter = attnres_inter(queries, torch.stack(self.blocks), norms, self.eps)

    def input_for(self, site: AttnResSite) -> torch.Tensor:
        if not self.two_phase:
            sources = self.blocks + ([self.partial] if self.partial is not None else [])
            return attnres_direct(site.query, torch.stack(sources), site.norm.weight, self.eps)
        assert self._inter is not None, "begin_block() comes before the block's sites"
        dtype = self.blocks[0].dtype
        row = self._inter.row(self._sites.index(site))
        return attnres_merge(row, site.query, self.partial, site.norm.weight, self.eps).to(dtype)

    def add(self, output: torch.Tensor) -> None:
        self.partial = output if self.partial is None else self.partial + output

    def end_block(self) -> None:
        if self.partial is not None:
            self.blocks.append(self.partial)
        self.partial = None
        self._inter = None

    def final(self, site: AttnResSite) -> torch.Tensor:
        """The output aggregation over all block sums (the last block may be incomplete)."""
        self.end_block()
        return attnres_direct(site.query, torch.stack(self.blocks), site.norm.weight, self.eps)
