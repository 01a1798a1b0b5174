"""Admitting a request: look its prompt up, pin the hit, allocate its pages, queue the restoring copies.

Every page of a hit is pinned before anything is allocated for it, because allocation may evict; room is
checked first, so an admission that cannot fit changes nothing (OutOfPages).
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from typing import TYPE_CHECKING

from k3core.cache.checkpoints import Checkpoint
from k3core.cache.cpu_tier import HostBlock, HostCheckpoint
from k3core.cache.hashing import chain_hashes
from k3core.cache.lookup import Hit
from k3core.cache.pool import OutOfPages, PageKind
from k3core.cache.prefix_index import Block
from k3core.cache.request import CachedRequest

if TYPE_CHECKING:
    from k3core.cache.manager import PrefixCacheManager


def new_request(rid: str, hash_block: int, tokens: Sequence[int] | None, chain: list[int] | None,
                num_tokens: int | None) -> CachedRequest:
    """A request from its tokens, or (metadata-only callers) from its chain hashes and length. With both
    tokens and chain, the chain (hashed off the scheduling step, e.g. where the request arrived) is used
    as given: hashing costs about 20 ns per token, 8 ms for a 400K-token prompt."""
    if tokens is not None:
        if chain is not None and len(chain) != len(tokens) // hash_block:
            raise ValueError(f"request {rid!r}: {len(chain)} chain hashes for {len(tokens)} tokens")
        # int64 array, converted once: hashing reads its bytes, and unlike a list it holds no objects for
        # the garbage collector to walk (a young 400K-element list costs every young-generation pass ms)
        own = array("q", tokens)
        hashes = list(chain) if chain is not None else chain_hashes(own, hash_block)
        req = CachedRequest(rid, hash_block, hashes, own, len(own), len(own))
    elif chain is not None and num_tokens is not None:
        req = CachedRequest(rid, hash_block, list(chain), None, num_tokens, num_tokens)
        if len(req.chain) != num_tokens // hash_block:
            raise ValueError(f"request {rid!r}: {len(chain)} chain hashes for {num_tokens} tokens")
    else:
        raise ValueError("add_request needs tokens, or chain and num_tokens")
    if req.num_tokens == 0:
        raise ValueError(f"request {rid!r} has no tokens")
    return req


class Admission:
    def __init__(self, manager: PrefixCacheManager) -> None:
        self.m = manager

    def verified_lookup(self, chain: list[int], num_tokens: int) -> Hit:
        """The best hit whose sources pass their integrity checks (a corrupt entry is dropped and counted,
        and the lookup redone: a shorter hit or a miss)."""
        m = self.m
        hit = m.finder.lookup(chain, num_tokens)
        while hit.num_tokens and not m.tiering.verify(hit):
            hit = m.finder.lookup(chain, num_tokens)
        return hit

    @staticmethod
    def _gpu_pages(hit: Hit) -> list[int]:
        pages = [p for src in hit.blocks if isinstance(src, Block) for p in src.pages]
        return pages + hit.checkpoint.pages if isinstance(hit.checkpoint, Checkpoint) else pages

    def pin(self, hit: Hit) -> None:
        """Reference every GPU page of the hit (and pin its host entries) until this step commits."""
        m = self.m
        for src in hit.blocks:
            if isinstance(src, Block):
                m.queue.pin(m.pool, src.pages)
            else:
                self._pin_host(src)
        checkpoint = hit.checkpoint
        if isinstance(checkpoint, Checkpoint):
            m.queue.pin(m.pool, checkpoint.pages)
            checkpoint.pins += 1
            m.queue.pinned_checkpoints.append(checkpoint)
            m.checkpoints.touch(checkpoint)
        elif checkpoint is not None:
            self._pin_host(checkpoint)

    def _pin_host(self, entry: HostBlock | HostCheckpoint) -> None:
        entry.pins += 1
        self.m.queue.pinned_host.append(entry)
        if self.m.cpu is not None:
            self.m.cpu.touch(entry)

    def admit(self, req: CachedRequest, hit: Hit) -> None:
        """Give `req` the hit: shared whole GPU blocks, private copies of host blocks and of the partial
        last block (copy-on-write: it may be another request's growth point), and private state pages that
        receive the hit checkpoint (or zeros on a miss) before the request's next forward."""
        m, lay = self.m, self.m.layout
        boundary = hit.num_tokens
        own = [k for k, src in enumerate(hit.blocks)
               if isinstance(src, HostBlock) or (k + 1) * lay.tokens_per_block > boundary]
        needed = lay.num_kda_groups + lay.num_mla_groups * len(own)
        idle_hit_pages = sum(m.pool.refcount[p] == 0 for p in self._gpu_pages(hit))  # pinning takes them
        if needed > m.pool.num_available - idle_hit_pages:
            raise OutOfPages(f"request {req.rid!r} needs {needed} pages, {m.pool.num_available} available")
        self.pin(hit)  # before any allocation: allocating may evict
        req.state_pages = m.pool.allocate_sets(PageKind.KDA, lay.num_kda_groups, 1)[0]
        fresh = iter(m.pool.allocate_sets(PageKind.MLA, lay.num_mla_groups, len(own)))
        for k, src in enumerate(hit.blocks):
            if k not in own:
                assert isinstance(src, Block)
                for page in src.pages:  # the request's own reference (the pin ends at commit)
                    m.pool.incref(page)
                req.blocks.append(src)
                continue
            tokens = min(lay.tokens_per_block, boundary - k * lay.tokens_per_block)
            block = m.tiering.copy_block(k, src, next(fresh), tokens)
            req.blocks.append(block)
            if tokens < lay.tokens_per_block:  # the private copy also holds the hit's endpoints: standby
                first = k * lay.hash_blocks_per_block
                for j in range(first, first + tokens // lay.hash_block_tokens):
                    m.index.register(req.chain[j], block, j - first + 1)
                m.retention.adopt(block.pages, block)
        if hit.checkpoint is None:
            m.queue.zero_pages += req.state_pages
        else:
            m.tiering.restore(hit.checkpoint, req.state_pages)
        if isinstance(hit.checkpoint, Checkpoint):
            req.hit_checkpoint = hit.checkpoint
            started = hit.checkpoint  # a turn end (its conversation's waypoints) or a waypoint itself
            req.waypoints = [*started.waypoints, started] if started.structural else list(started.waypoints)
        req.num_computed = req.hit_tokens = boundary
        if m.policy.branch_points and hit.mla_tokens > boundary:
            req.branch_point = hit.mla_tokens
        m.queue.touched.add(req.rid)
