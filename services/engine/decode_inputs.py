"""The per-step inputs of a decode forward as one int64 buffer: built on the host, copied in one transfer.

Rows past the real batch (padding up to the CUDA-graph bucket) point at two scratch pages the fast path
owns (a KDA page for the states, an MLA page for the latent row and its one-row attention), so the padded
rows compute harmless garbage and never touch a request's pages.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from k3core.cache.layout import PoolLayout
from k3core.cache.request import CachedRequest


@dataclass
class DecodeInputs:
    """Views into one flat int64 tensor (device side), for a batch of `size` rows."""

    flat: torch.Tensor
    tokens: torch.Tensor  # [B]
    kda_slots: torch.Tensor  # [kda groups, B]: the state page of each row
    page_table: torch.Tensor  # [mla groups, B, max_pages]
    lengths: torch.Tensor  # [B]: tokens after this step (context + 1)
    row_base: torch.Tensor  # [mla groups, B]: row of layer slot 0 of the new token in PoolViews.mla_rows()

    @classmethod
    def view(cls, flat: torch.Tensor, size: int, kda_groups: int, mla_groups: int, max_pages: int) -> DecodeInputs:
        sizes = [size, kda_groups * size, mla_groups * size * max_pages, size, mla_groups * size]
        parts = flat[: sum(sizes)].split(sizes)
        return cls(flat, parts[0], parts[1].view(kda_groups, size), parts[2].view(mla_groups, size, max_pages),
                   parts[3], parts[4].view(mla_groups, size))

    @staticmethod
    def numel(size: int, kda_groups: int, mla_groups: int, max_pages: int) -> int:
        return size * (2 + kda_groups + mla_groups * (max_pages + 1))


class DecodeInputBuilder:
    """Fills the host image of DecodeInputs for the requests of a step (page tables cached per request)."""

    def __init__(self, layout: PoolLayout, max_pages: int, scratch_kda: int, scratch_mla: int) -> None:
        self.layout = layout
        self.max_pages = max_pages
        self.scratch_kda, self.scratch_mla = scratch_kda, scratch_mla
        self.kda_groups, self.mla_groups = layout.num_kda_groups, layout.num_mla_groups
        self._tables: dict[str, tuple[tuple, np.ndarray]] = {}

    def fits(self, req: CachedRequest) -> bool:
        return len(req.blocks) <= self.max_pages

    def _table(self, req: CachedRequest) -> np.ndarray:
        """[mla groups, max_pages] page ids of a request's block table (rebuilt when the table changes)."""
        key = (id(req), len(req.blocks), req.blocks[0].pages[0], req.blocks[-1].pages[0])
        cached = self._tables.get(req.rid)
        if cached is not None and cached[0] == key:
            return cached[1]
        table = np.full((self.mla_groups, self.max_pages), self.scratch_mla, dtype=np.int64)
        table[:, : len(req.blocks)] = np.array([b.pages for b in req.blocks], dtype=np.int64).T
        self._tables[req.rid] = (key, table)
        return table

    def _prune(self, requests: list[CachedRequest]) -> None:
        """Drop the tables of finished requests once they outnumber the live ones."""
        if len(self._tables) > 2 * len(requests) + 64:
            live = {r.rid for r in requests}
            for rid in [r for r in self._tables if r not in live]:
                del self._tables[rid]

    def numel(self, size: int) -> int:
        return DecodeInputs.numel(size, self.kda_groups, self.mla_groups, self.max_pages)

    def view(self, flat: torch.Tensor, size: int) -> DecodeInputs:
        return DecodeInputs.view(flat, size, self.kda_groups, self.mla_groups, self.max_pages)

    def build(self, requests: list[CachedRequest], tokens: list[int], size: int,
              out: np.ndarray | None = None) -> np.ndarray:
        """Host int64 image for `size` rows (len(requests) real rows, the rest padding), into `out` if given."""
        n, per_block = len(requests), self.layout.tokens_per_block
        out = np.empty(self.numel(size), dtype=np.int64) if out is None else out[: self.numel(size)]
        image = self.view(torch.from_numpy(out), size)
        tok, slots, table = image.tokens.numpy(), image.kda_slots.numpy(), image.page_table.numpy()
        lengths, base = image.lengths.numpy(), image.row_base.numpy()
        tok[:] = 0
        slots[:] = self.scratch_kda
        table[:] = self.scratch_mla
        lengths[:] = 1
        base[:] = self.scratch_mla * per_block * self.layout.layers_per_group
        if n:
            self._prune(requests)
            tok[:n] = tokens
            slots[:, :n] = np.array([r.state_pages for r in requests], dtype=np.int64).T
            table[:, :n] = np.stack([self._table(r) for r in requests], axis=1)
            position = np.array([r.num_computed for r in requests], dtype=np.int64)
            lengths[:n] = position + 1
            block = position // per_block
            pages = table[:, np.arange(n), block]  # [mla groups, n]
            base[:, :n] = (pages * per_block + position % per_block) * self.layout.layers_per_group
        return out
