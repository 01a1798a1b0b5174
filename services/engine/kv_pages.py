"""A request's cache pages as transfer pages: export on the prefill side, import on the decode side.

Exported per request: one KDA state page per KDA group (the state after the last computed token; each
page is head-major over this rank's heads) and, from TP rank 0 only, every MLA page of its block table
(the latent is replicated, so one rank's copy serves every consumer rank). Only the used bytes of a page
travel. Import writes each page into the request's own pages; MLA blocks
that the decode worker already shares through its prefix cache are skipped (same tokens, same bytes).
"""

from __future__ import annotations

import torch

from k3.v1 import common_pb2
from k3core.cache.manager import PrefixCacheManager
from services.runtime import errors


def export_request(manager: PrefixCacheManager, rid: str, *, replicated: bool = True
                   ) -> tuple[list[common_pb2.PageRef], list[bytes]]:
    """`rid`'s pages as transfer pages; `replicated=False` leaves out the MLA pages (ranks > 0)."""
    req = manager.requests[rid]
    store, lay = manager.store, manager.layout
    assert store is not None
    refs, pages = [], []
    for group, page in enumerate(req.state_pages):
        data, fp = store.export_page(page, lay.kda_page_used_bytes)
        refs.append(common_pb2.PageRef(kind=common_pb2.CACHE_KIND_KDA_STATE, group=group, block_index=0,
                                       token_start=req.num_computed, token_count=0, num_bytes=data.numel(),
                                       fingerprint=fp))
        pages.append(data.numpy().tobytes())
    if not replicated:
        return refs, pages
    per_block = lay.tokens_per_block
    for index, block in enumerate(req.blocks):
        start = index * per_block
        count = max(0, min(per_block, req.num_computed - start))
        for group, page in enumerate(block.pages):
            data, fp = store.export_page(page, lay.mla_page_used_bytes)
            refs.append(common_pb2.PageRef(kind=common_pb2.CACHE_KIND_MLA_LATENT, group=group, block_index=index,
                                           token_start=start, token_count=count, num_bytes=data.numel(),
                                           fingerprint=fp))
            pages.append(data.numpy().tobytes())
    return refs, pages


def import_request(manager: PrefixCacheManager, rid: str, refs: list[common_pb2.PageRef],
                   pages: list[bytes], shared_tokens: int) -> None:
    """Write pulled pages into `rid`'s pages. `shared_tokens`: the local prefix hit (its full blocks are
    shared with other requests and already hold these bytes)."""
    req = manager.requests[rid]
    store, lay = manager.store, manager.layout
    assert store is not None
    kda = [(r, p) for r, p in zip(refs, pages, strict=True) if r.kind == common_pb2.CACHE_KIND_KDA_STATE]
    mla = [(r, p) for r, p in zip(refs, pages, strict=True) if r.kind == common_pb2.CACHE_KIND_MLA_LATENT]
    if len(kda) != lay.num_kda_groups or len(mla) != lay.num_mla_groups * len(req.blocks):
        raise errors.FailedPrecondition(
            f"handle has {len(kda)} KDA and {len(mla)} MLA pages; this worker expects {lay.num_kda_groups} and "
            f"{lay.num_mla_groups * len(req.blocks)} (different model, hash block or page layout?)")
    for ref, data in kda + mla:
        expected = lay.kda_page_used_bytes if ref.kind == common_pb2.CACHE_KIND_KDA_STATE else lay.mla_page_used_bytes
        if ref.num_bytes != expected or len(data) != expected:
            raise errors.FailedPrecondition(f"page of {ref.num_bytes} bytes where this worker's layout has "
                                            f"{expected} (incompatible cache layouts)")
    for ref, data in kda:
        store.import_page(req.state_pages[ref.group], _as_tensor(data), ref.fingerprint)
    shared_blocks = shared_tokens // lay.tokens_per_block
    for ref, data in mla:
        if ref.block_index >= shared_blocks:
            store.import_page(req.blocks[ref.block_index].pages[ref.group], _as_tensor(data), ref.fingerprint)


def _as_tensor(data: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)
