"""`PagedBatchCache`: the model's `BatchCache` protocol over the paged pool for one scheduling step.

Each sequence brings its private KDA state pages (one per KDA group) and its MLA block table. The model
reads and writes through typed views of those pages; on a GPU the same page ids feed the paged kernels.
"""

from __future__ import annotations

import torch

from k3core.cache.page_store import PageStore
from k3core.cache.request import CachedRequest


class PagedBatchCache:
    def __init__(self, store: PageStore, requests: list[CachedRequest]) -> None:
        self.store = store
        self.layout = store.layout
        self._requests = requests
        for req in requests:
            if req.scheduled <= 0:
                raise ValueError(f"request {req.rid!r} has no tokens reserved for this step")
        self._context = [r.num_computed for r in requests]
        self._new = [r.scheduled for r in requests]
        self._mla_written: set[int] = set()

    @property
    def num_sequences(self) -> int:
        return len(self._requests)

    @property
    def context_lens(self) -> list[int]:
        return list(self._context)

    @property
    def new_token_counts(self) -> list[int]:
        return list(self._new)

    def kda_read(self, kda_layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        group, slot = self.layout.kda_slot(kda_layer)
        views = [self.store.kda_views(r.state_pages[group], slot) for r in self._requests]
        return torch.stack([c for c, _ in views]), torch.stack([s for _, s in views])

    def kda_write(self, kda_layer: int, conv_state: torch.Tensor, recurrent_state: torch.Tensor) -> None:
        group, slot = self.layout.kda_slot(kda_layer)
        for i, req in enumerate(self._requests):
            conv, recurrent = self.store.kda_views(req.state_pages[group], slot)
            conv.copy_(conv_state[i])
            recurrent.copy_(recurrent_state[i])

    def _spans(self, start: int, end: int) -> list[tuple[int, int, int, int]]:
        """(page-local block index, first row, last row, offset into the token run) covering [start, end)."""
        per_block = self.layout.tokens_per_block
        spans = []
        pos = start
        while pos < end:
            block, row = divmod(pos, per_block)
            stop = min(end, (block + 1) * per_block)
            spans.append((block, row, row + stop - pos, pos - start))
            pos = stop
        return spans

    def mla_append(self, mla_layer: int, latent: torch.Tensor) -> None:
        group, slot = self.layout.mla_slot(mla_layer)
        if latent.shape[0] != sum(self._new):
            raise ValueError(f"mla_append got {latent.shape[0]} rows for {sum(self._new)} new tokens")
        offset = 0
        for seq, req in enumerate(self._requests):
            start = self._context[seq]
            for block, first, last, at in self._spans(start, start + self._new[seq]):
                rows = self.store.mla_rows(req.blocks[block].pages[group], slot)
                rows[first:last].copy_(latent[offset + at : offset + at + last - first])
            offset += self._new[seq]
        self._mla_written.add(mla_layer)

    def mla_read(self, mla_layer: int, seq: int) -> torch.Tensor:
        group, slot = self.layout.mla_slot(mla_layer)
        req = self._requests[seq]
        rows = self._context[seq] + (self._new[seq] if mla_layer in self._mla_written else 0)
        parts = [self.store.mla_rows(req.blocks[block].pages[group], slot)[first:last]
                 for block, first, last, _ in self._spans(0, rows)]
        return torch.cat(parts) if parts else self.store.mla_rows(req.blocks[0].pages[group], slot)[:0]
