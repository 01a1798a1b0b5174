"""The scheduler-facing prefix-cache manager: one paged pool, two caches, fine-grained reuse.

A scheduling step goes:
    manager.add_request(...)        lookup + pin the hit + allocate private state (new requests)
    manager.append_tokens(...)      tokens that became known (a decode step's sampled token)
    manager.reserve(rid, n)         pages for the next n tokens of each scheduled request
    manager.pre_forward()           restore / copy-on-write / prefetch copies land before the forward
    model(..., cache=manager.batch_view(rids))
    manager.forward_done(rid)       register new hash endpoints, snapshot the KDA state (pending)
    manager.commit_step()           snapshot copies land; this step's registrations become matchable
    manager.finish(rid)             keep the turn-boundary checkpoint, release the request's pages

Everything registered in a step (hash endpoints, checkpoints, prefetched blocks) is invisible to lookups
and pinned against eviction until `commit_step`, because its bytes land only with the step's copies and
forward. Every page of a hit is pinned before anything is allocated for it, because allocation may evict.
"""

from __future__ import annotations

from collections.abc import Sequence

from k3core.cache.checkpoints import Checkpoint, CheckpointPolicy, CheckpointStore
from k3core.cache.cpu_tier import CpuTier, HostBlock, HostCheckpoint
from k3core.cache.hashing import chain_hashes
from k3core.cache.layout import PoolLayout
from k3core.cache.lookup import Hit, PrefixLookup
from k3core.cache.metrics import CacheMetrics
from k3core.cache.page_store import CopyOp, PageStore
from k3core.cache.paged_view import PagedBatchCache
from k3core.cache.pool import OutOfPages, PageKind, PagePool
from k3core.cache.prefix_index import Block, PrefixIndex
from k3core.cache.request import CachedRequest
from k3core.cache.tiering import Tiering


class PrefixCacheManager:
    def __init__(self, layout: PoolLayout, num_pages: int, *, policy: CheckpointPolicy | None = None,
                 device: str | None = None, debug: bool = False, cpu_tier: CpuTier | None = None,
                 metrics: CacheMetrics | None = None, verify_restore: bool = True) -> None:
        """`device=None` runs metadata only (no tensors); otherwise pages live in a tensor on `device`."""
        self.layout = layout
        self.policy = policy or CheckpointPolicy()
        self.pool = PagePool(num_pages)
        self.store = PageStore(layout, self.pool, device, debug) if device is not None else None
        self.index = PrefixIndex()
        cap = int(self.policy.max_pool_fraction * num_pages)
        self.checkpoints = CheckpointStore(pages_per_checkpoint=layout.num_kda_groups, max_pages=cap)
        self.cpu = cpu_tier
        self.metrics = metrics
        self.verify_restore = verify_restore
        self.finder = PrefixLookup(self.index, self.checkpoints, cpu_tier, layout.hash_block_tokens,
                                   layout.hash_blocks_per_block)
        self.tiering = Tiering(self)
        self.requests: dict[str, CachedRequest] = {}
        self._pre_ops: list[CopyOp] = []
        self._zero_pages: list[int] = []
        self._post_ops: list[CopyOp] = []
        self._unpin_pages: list[int] = []  # page refs held until this step's copies land
        self._unpin_checkpoints: list[Checkpoint] = []
        self._unpin_host: list[HostBlock | HostCheckpoint] = []
        self._dirty: set[str] = set()  # requests forwarded in the current step
        self.integrity_errors = 0

    @property
    def step_open(self) -> bool:
        """Whether copies, pins or registrations of the current step are waiting for `commit_step`."""
        return bool(self._pre_ops or self._zero_pages or self._post_ops or self._unpin_pages
                    or self._unpin_host or self._dirty)

    # ---- lookup and admission -------------------------------------------------------------------------
    def lookup(self, chain: list[int], num_tokens: int) -> Hit:
        """Side-effect-free two-phase lookup (for routing decisions); `add_request` does its own."""
        return self.finder.lookup(chain, num_tokens)

    def add_request(self, rid: str, tokens: Sequence[int] | None = None, *, chain: list[int] | None = None,
                    num_tokens: int | None = None) -> int:
        """Admit a request: look its prompt up, pin the hit, allocate its private state and queue the copies
        that restore the hit. Returns the number of prompt tokens served from the cache (prefill resumes
        there). Raises OutOfPages with nothing changed when the pool cannot hold it."""
        if rid in self.requests:
            raise ValueError(f"request {rid!r} already added")
        hb = self.layout.hash_block_tokens
        if tokens is not None:
            req = CachedRequest(rid, hb, chain_hashes(tokens, hb), list(tokens), len(tokens), len(tokens))
        elif chain is not None and num_tokens is not None:
            req = CachedRequest(rid, hb, list(chain), None, num_tokens, num_tokens)
            if len(req.chain) != num_tokens // hb:
                raise ValueError(f"request {rid!r}: {len(chain)} chain hashes for {num_tokens} tokens")
        else:
            raise ValueError("add_request needs tokens, or chain and num_tokens")
        if req.num_tokens == 0:
            raise ValueError(f"request {rid!r} has no tokens")
        hit = self.finder.lookup(req.chain, req.num_tokens)
        while hit.num_tokens and not self.tiering.verify(hit):
            hit = self.finder.lookup(req.chain, req.num_tokens)  # the bad entry is gone; take the next best
        self._admit(req, hit)
        self.requests[rid] = req
        if self.metrics is not None:
            self.metrics.lookup_tokens.inc(req.num_tokens)
            self.metrics.hit_tokens.inc(hit.num_tokens)
            if hit.num_tokens:
                self.metrics.hit_boundary.observe(hit.num_tokens)
        return hit.num_tokens

    @staticmethod
    def _gpu_pages(hit: Hit) -> list[int]:
        pages = [p for src in hit.blocks if isinstance(src, Block) for p in src.pages]
        return pages + hit.checkpoint.pages if isinstance(hit.checkpoint, Checkpoint) else pages

    def _pin(self, hit: Hit) -> None:
        """Reference every GPU page of the hit (and pin its host entries) until this step commits."""
        for src in hit.blocks:
            if isinstance(src, Block):
                for page in src.pages:
                    self.pool.incref(page)
                self._unpin_pages += src.pages
            else:
                self._pin_host(src)
        checkpoint = hit.checkpoint
        if isinstance(checkpoint, Checkpoint):
            for page in checkpoint.pages:
                self.pool.incref(page)
            self._unpin_pages += checkpoint.pages
            checkpoint.pins += 1
            self._unpin_checkpoints.append(checkpoint)
            self.checkpoints.touch(checkpoint)
        elif checkpoint is not None:
            self._pin_host(checkpoint)

    def _pin_host(self, entry: HostBlock | HostCheckpoint) -> None:
        entry.pins += 1
        self._unpin_host.append(entry)
        if self.cpu is not None:
            self.cpu.touch(entry)

    def _admit(self, req: CachedRequest, hit: Hit) -> None:
        lay = self.layout
        boundary = hit.num_tokens
        # Blocks the request needs its own pages for: prefetched from the host, or the partial last block
        # (copy-on-write: the shared page may be another request's growth point).
        own = [k for k, src in enumerate(hit.blocks)
               if isinstance(src, HostBlock) or (k + 1) * lay.tokens_per_block > boundary]
        needed = lay.num_kda_groups + lay.num_mla_groups * len(own)
        idle_hit_pages = sum(self.pool.refcount[p] == 0 for p in self._gpu_pages(hit))  # pinning takes them
        if needed > self.pool.num_available - idle_hit_pages:
            raise OutOfPages(f"request {req.rid!r} needs {needed} pages, {self.pool.num_available} available")
        self._pin(hit)  # before any allocation: allocating may evict
        req.state_pages = self._allocate(PageKind.KDA, lay.num_kda_groups, 1)[0]
        fresh = iter(self._allocate(PageKind.MLA, lay.num_mla_groups, len(own)))
        for k, src in enumerate(hit.blocks):
            if k not in own:
                assert isinstance(src, Block)
                for page in src.pages:  # the request's own reference (the pin ends at commit)
                    self.pool.incref(page)
                req.blocks.append(src)
                continue
            tokens = min(lay.tokens_per_block, boundary - k * lay.tokens_per_block)
            block = self.tiering.copy_block(k, src, next(fresh), tokens)
            req.blocks.append(block)
            if tokens < lay.tokens_per_block:  # the private copy also holds the hit's endpoints: standby
                first = k * lay.hash_blocks_per_block
                for j in range(first, first + tokens // lay.hash_block_tokens):
                    self.index.register(req.chain[j], block, j - first + 1)
                for page in block.pages:
                    self.pool.adopt(page, block)
        if hit.checkpoint is None:
            self._zero_pages += req.state_pages
        else:
            self.tiering.restore(hit.checkpoint, req.state_pages)
        req.num_computed = req.hit_tokens = boundary

    def _allocate(self, kind: PageKind, groups: int, count: int) -> list[list[int]]:
        """`count` page sets of one page per cache group (callers check availability first)."""
        per_group = [self.pool.allocate(kind, g, count) for g in range(groups)]
        return [[per_group[g][i] for g in range(groups)] for i in range(count)]

    def prefetch(self, chain: list[int], num_tokens: int) -> int:
        """Bring the CPU-tier part of a future hit back to the GPU ahead of its request (matchable after
        commit). Returns the boundary staged, 0 when nothing was (no hit, already resident, no room)."""
        hit = self.finder.lookup(chain, num_tokens)
        while hit.num_tokens and not self.tiering.verify(hit):
            hit = self.finder.lookup(chain, num_tokens)
        return self.tiering.prefetch(hit, list(chain)) if hit.num_tokens else 0

    # ---- growth ---------------------------------------------------------------------------------------
    def append_tokens(self, rid: str, tokens: Sequence[int]) -> None:
        self.requests[rid].append_tokens(tokens)

    def append_hashes(self, rid: str, num_new_tokens: int, chain: Sequence[int]) -> None:
        self.requests[rid].append_hashes(num_new_tokens, chain)

    def prefill_chunk(self, rid: str, budget: int) -> int:
        """How many tokens to prefill next within `budget` so that the forward ends on a hash boundary
        (where its final state can be checkpointed); the unaligned remainder of the prompt runs alone."""
        req, hb = self.requests[rid], self.layout.hash_block_tokens
        aligned_end = req.num_tokens // hb * hb
        end = min(req.num_computed + budget, req.num_tokens)
        if req.num_computed < aligned_end:
            end = min(end, aligned_end)
            if end // hb * hb > req.num_computed:
                end = end // hb * hb
        return end - req.num_computed

    def reserve(self, rid: str, num_new_tokens: int) -> None:
        """Pages for the next `num_new_tokens` tokens of a request in this step (OutOfPages: none taken)."""
        req = self.requests[rid]
        if num_new_tokens <= 0 or req.num_computed + num_new_tokens > req.num_tokens:
            raise ValueError(f"request {rid!r}: cannot schedule {num_new_tokens} tokens at "
                             f"{req.num_computed}/{req.num_tokens}")
        per_block = self.layout.tokens_per_block
        need = -(-(req.num_computed + num_new_tokens) // per_block) - len(req.blocks)
        if need > 0:
            if need * self.layout.num_mla_groups > self.pool.num_available:
                raise OutOfPages(f"request {rid!r} needs {need} more blocks")
            for pages in self._allocate(PageKind.MLA, self.layout.num_mla_groups, need):
                req.blocks.append(Block(len(req.blocks), pages, self.tiering.evict_block))
        req.scheduled = num_new_tokens

    def batch_view(self, rids: Sequence[str]) -> PagedBatchCache:
        if self.store is None:
            raise RuntimeError("metadata-only manager has no tensors to view")
        return PagedBatchCache(self.store, [self.requests[r] for r in rids])

    def pre_forward(self) -> list[CopyOp]:
        """Run (with a store) and return the copies that must land before this step's forward."""
        ops, self._pre_ops = self._pre_ops, []
        if self.store is not None:
            for page in self._zero_pages:
                self.store.zero(page)
            self.store.run(ops)
        self._zero_pages = []
        return ops

    def forward_done(self, rid: str) -> None:
        """The forward over the reserved tokens ran: register the hash blocks it completed and snapshot
        the KDA state if it ended on a hash boundary. Both stay pending until `commit_step`."""
        req = self.requests[rid]
        if req.scheduled <= 0:
            raise ValueError(f"request {rid!r} has no reserved tokens")
        hb, per_block = self.layout.hash_block_tokens, self.layout.hash_blocks_per_block
        start = req.num_computed
        req.num_computed += req.scheduled
        req.scheduled = 0
        self._dirty.add(rid)
        for j in range(start // hb, min(req.num_computed // hb, len(req.chain))):
            block = req.blocks[j // per_block]
            covered = j % per_block + 1
            block.filled = covered
            self.index.register(req.chain[j], block, covered)
            if self.pool.owner[block.pages[0]] is None:
                for page in block.pages:
                    self.pool.adopt(page, block)
        if req.num_computed % hb == 0:
            self._snapshot(req)

    def _snapshot(self, req: CachedRequest) -> None:
        hb = self.layout.hash_block_tokens
        end = req.num_computed // hb
        if end > len(req.chain) or end % self.policy.every_hash_blocks:
            return
        key = req.chain[end - 1]
        turn = end == req.prompt_tokens // hb
        checkpoint = self.checkpoints.by_key.get(key)
        if checkpoint is None:
            checkpoint = self._new_checkpoint(req, key)
            if checkpoint is None:
                return
        checkpoint.keep |= turn and self.policy.keep_prompt_end
        previous, req.latest = req.latest, checkpoint
        if (previous is not None and previous is not checkpoint and self.policy.supersede
                and previous.owner == req.rid and not previous.keep):
            self.drop_checkpoint(previous)

    def _new_checkpoint(self, req: CachedRequest, key: int) -> Checkpoint | None:
        groups = self.layout.num_kda_groups
        victims = self.checkpoints.victims_for(groups)
        if victims is None or groups > self.pool.num_available:
            if self.metrics is not None:
                self.metrics.checkpoints_skipped.inc()
            return None
        for victim in victims:
            self.tiering.evict_checkpoint(victim)
        pages = self._allocate(PageKind.KDA, groups, 1)[0]
        checkpoint = Checkpoint(key, req.num_computed, pages, req.chain, self.tiering.evict_checkpoint,
                                owner=req.rid)
        self.checkpoints.add(checkpoint)
        for page in pages:
            self.pool.adopt(page, checkpoint)
        nbytes = self.layout.kda_page_used_bytes
        self._post_ops += [CopyOp(dst, nbytes, src_page=src) for dst, src in zip(pages, req.state_pages, strict=True)]
        self._unpin_pages += pages  # the allocation reference holds the pages until the copy lands
        return checkpoint

    def drop_checkpoint(self, checkpoint: Checkpoint) -> None:
        """Unregister a checkpoint in every group at once and release its pages (no write-back)."""
        if self.checkpoints.by_key.get(checkpoint.key) is not checkpoint:
            return  # already evicted
        self.checkpoints.remove(checkpoint)
        for page in checkpoint.pages:
            self.pool.release(page)

    # ---- step end -------------------------------------------------------------------------------------
    def commit_step(self) -> None:
        """This step's copies and forward have landed: make its registrations matchable, drop its pins."""
        if self._pre_ops or self._zero_pages:
            self.pre_forward()
        if self.store is not None:
            self.store.run(self._post_ops)
            used = self.layout.kda_page_used_bytes
            for checkpoint in self.checkpoints.pending():
                checkpoint.fingerprints = [self.store.fingerprint(p, used) for p in checkpoint.pages]
        self._post_ops = []
        self.checkpoints.commit()
        self.index.commit()
        for page in self._unpin_pages:
            self.pool.decref(page)
        for checkpoint in self._unpin_checkpoints:
            checkpoint.pins -= 1
        for entry in self._unpin_host:
            entry.pins -= 1
        self._unpin_pages, self._unpin_checkpoints, self._unpin_host = [], [], []
        self._dirty.clear()
        if self.metrics is not None:
            self.metrics.checkpoint_bytes.set(self.checkpoints.num_pages * self.layout.page_bytes)

    def finish(self, rid: str, turn_boundary: bool = True) -> None:
        """Release a finished (or aborted, `turn_boundary=False`) request. Its latest checkpoint is the
        state at the last hash boundary of the conversation so far: kept for the next turn."""
        req = self.requests.pop(rid)
        latest = req.latest
        if turn_boundary and latest is not None and self.checkpoints.by_key.get(latest.key) is latest:
            latest.keep = True
            self.checkpoints.touch(latest)
            for page in latest.pages:
                self.pool.touch(page)
        # Tail blocks first, so that under LRU a prefix's end is evicted before its shared head.
        pages = [p for block in reversed(req.blocks) for p in block.pages] + req.state_pages
        if rid in self._dirty:
            self._unpin_pages += pages  # this step's copies may still read them
        else:
            for page in pages:
                self.pool.decref(page)

    def evict_idle(self, num_pages: int) -> int:
        """Evict idle cached entries (LRU first; written back to the CPU tier when there is one) until
        `num_pages` pages are free or nothing idle is left. Returns the pages freed."""
        freed = 0
        while freed < num_pages and self.pool.num_cached:
            freed += self.pool.evict_one()
        return freed
