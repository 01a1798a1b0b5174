"""Synthetic cache pages for transfer tests: a global per-head byte content, split across producer ranks.

The oracle for any consumer rank is built straight from the global content (the heads it owns,
concatenated), independently of the re-layout code under test.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from k3.v1 import common_pb2
from services.kvtransfer.relayout import page_fingerprint, rank_layout

MLA = common_pb2.CACHE_KIND_MLA_LATENT
KDA = common_pb2.CACHE_KIND_KDA_STATE


@dataclass
class GlobalCache:
    total_heads: int
    kinds: list[int]
    # MLA page: bytes; KDA page: one bytes object per head.
    content: list[bytes | list[bytes]]

    @classmethod
    def random(cls, total_heads: int, seed: int, mla_pages: int = 2, kda_pages: int = 3,
               mla_bytes: int = 3000, head_bytes: int = 800) -> GlobalCache:
        rng = random.Random(seed)
        kinds = [MLA] * mla_pages + [KDA] * kda_pages
        content: list[bytes | list[bytes]] = [rng.randbytes(mla_bytes) for _ in range(mla_pages)]
        content += [[rng.randbytes(head_bytes) for _ in range(total_heads)] for _ in range(kda_pages)]
        return cls(total_heads, kinds, content)

    def rank_pages(self, layout: common_pb2.TensorParallelLayout) -> list[bytes]:
        heads = range(layout.head_start, layout.head_start + layout.head_count)
        return [c if isinstance(c, bytes) else b"".join(c[h] for h in heads) for c in self.content]

    def producer_part(self, handle_id: str, tp_size: int, rank: int, *, whole: bool = False
                      ) -> tuple[common_pb2.KVHandle, list[bytes]]:
        """What producer `rank` pushes: rank 0 every page, the others their KDA pages only (as the
        workers do), or every page when `whole` (as producers did before MLA pages were sent once)."""
        layout = rank_layout(self.total_heads, tp_size, rank)
        sent = [(i, kind, data) for i, (kind, data) in enumerate(zip(self.kinds, self.rank_pages(layout), strict=True))
                if rank == 0 or whole or kind != MLA]
        pages = [data for _, _, data in sent]
        refs = [common_pb2.PageRef(kind=kind, group=i, block_index=i, num_bytes=len(data),
                                   fingerprint=page_fingerprint(data)) for i, kind, data in sent]
        handle = common_pb2.KVHandle(handle_id=handle_id, request_id="req-" + handle_id, layout=layout,
                                     num_tokens=100, pages=refs, model="nano")
        return handle, pages
