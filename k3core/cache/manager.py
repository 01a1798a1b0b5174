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
forward (`step_queue`). Admission is in `admission`, checkpoint taking in `snapshots`, data movement
between tiers in `tiering`, and the order in which idle entries are evicted in `retention`.
"""

from __future__ import annotations

from collections.abc import Sequence

from k3core.cache.admission import Admission, new_request
from k3core.cache.checkpoints import Checkpoint, CheckpointPolicy, CheckpointStore
from k3core.cache.cpu_tier import CpuTier
from k3core.cache.layout import PoolLayout
from k3core.cache.lookup import Hit, PrefixLookup
from k3core.cache.metrics import CacheMetrics
from k3core.cache.page_store import CopyOp, PageStore, PendingFingerprints
from k3core.cache.paged_view import PagedBatchCache
from k3core.cache.pool import OutOfPages, PageKind, PagePool
from k3core.cache.prefix_index import Block, PrefixIndex
from k3core.cache.request import CachedRequest
from k3core.cache.retention import RetentionPolicy
from k3core.cache.snapshots import Snapshots
from k3core.cache.step_queue import StepQueue
from k3core.cache.tiering import Tiering


class PrefixCacheManager:
    def __init__(self, layout: PoolLayout, num_pages: int, *, policy: CheckpointPolicy | None = None,
                 device: str | None = None, debug: bool = False, cpu_tier: CpuTier | None = None,
                 metrics: CacheMetrics | None = None, verify_restore: bool = True) -> None:
        """`device=None` runs metadata only (no tensors); otherwise pages live in a tensor on `device`."""
        self.layout = layout
        self.policy = policy or CheckpointPolicy()
        value_aware = self.policy.eviction == "value"
        self.pool = PagePool(num_pages, RetentionPolicy.num_tiers(value_aware))
        self.store = PageStore(layout, self.pool, device, debug) if device is not None else None
        self.index = PrefixIndex()
        cap = int(self.policy.max_pool_fraction * num_pages)
        self.checkpoints = CheckpointStore(pages_per_checkpoint=layout.num_kda_groups, max_pages=cap)
        self.cpu = cpu_tier
        self.metrics = metrics
        self.verify_restore = verify_restore
        self.finder = PrefixLookup(self.index, self.checkpoints, cpu_tier, layout.hash_block_tokens,
                                   layout.hash_blocks_per_block)
        self.retention = RetentionPolicy(self.pool, self.index, layout, value_aware)
        self.queue = StepQueue()
        self.tiering = Tiering(self)
        self.admission = Admission(self)
        self.snapshots = Snapshots(self)
        self.requests: dict[str, CachedRequest] = {}
        self.integrity_errors = 0
        # checkpoints committed with their checksum still on the device (`commit_step`, `settle_fingerprints`)
        self._unsettled: list[tuple[list[Checkpoint], PendingFingerprints]] = []
        # read on every request of every step
        self._hash_block = layout.hash_block_tokens
        self._hash_blocks_per_block = layout.hash_blocks_per_block
        self._tokens_per_block = layout.tokens_per_block

    @property
    def step_open(self) -> bool:
        """Whether copies, pins or registrations of the current step are waiting for `commit_step`."""
        return self.queue.open

    # ---- lookup and admission -------------------------------------------------------------------------
    def lookup(self, chain: list[int], num_tokens: int) -> Hit:
        """Side-effect-free two-phase lookup (for routing decisions); `add_request` does its own."""
        return self.finder.lookup(chain, num_tokens)

    def add_request(self, rid: str, tokens: Sequence[int] | None = None, *, chain: list[int] | None = None,
                    num_tokens: int | None = None, cacheable: bool = True) -> int:
        """Admit a request: look its prompt up, pin the hit, allocate its private state and queue the copies
        that restore the hit. Returns the number of prompt tokens served from the cache (prefill resumes
        there). Raises OutOfPages with nothing changed when the pool cannot hold it. `chain` may come with
        `tokens`: hashes computed before the step (`hashing.chain_hashes`), so admission does not hash.
        `cacheable=False` (scratch work, e.g. a worker's warm-up): `num_tokens` only, no lookup and no chain
        hashes, so none of its blocks is ever registered nor its state checkpointed; returns 0."""
        if rid in self.requests:
            raise ValueError(f"request {rid!r} already added")
        if not cacheable:
            if tokens is not None or chain is not None or num_tokens is None or num_tokens <= 0:
                raise ValueError(f"request {rid!r}: a scratch request takes num_tokens > 0 only")
            req = CachedRequest(rid, self._hash_block, num_tokens=num_tokens, prompt_tokens=num_tokens)
            self.admission.admit(req, Hit())  # a miss: zeroed state, no page of anyone else
            self.requests[rid] = req
            return 0
        req = new_request(rid, self.layout.hash_block_tokens, tokens, chain, num_tokens)
        hit = self.admission.verified_lookup(req.chain, req.num_tokens)
        self.admission.admit(req, hit)
        self.requests[rid] = req
        if self.metrics is not None:
            self.metrics.lookup_tokens.inc(req.num_tokens)
            self.metrics.hit_tokens.inc(hit.num_tokens)
            if hit.num_tokens:
                self.metrics.hit_boundary.observe(hit.num_tokens)
        return hit.num_tokens

    def prefetch(self, chain: list[int], num_tokens: int) -> int:
        """Bring the CPU-tier part of a future hit back to the GPU ahead of its request (matchable after
        commit). Returns the boundary staged, 0 when nothing was (no hit, already resident, no room)."""
        hit = self.admission.verified_lookup(chain, num_tokens)
        return self.tiering.prefetch(hit, list(chain)) if hit.num_tokens else 0

    # ---- growth ---------------------------------------------------------------------------------------
    def append_tokens(self, rid: str, tokens: Sequence[int]) -> None:
        self.requests[rid].append_tokens(tokens)

    def append_hashes(self, rid: str, num_new_tokens: int, chain: Sequence[int]) -> None:
        self.requests[rid].append_hashes(num_new_tokens, chain)

    def prefill_chunk(self, rid: str, budget: int) -> int:
        """How many tokens to prefill next within `budget` so that the forward ends on a hash boundary
        (where its final state can be checkpointed); the unaligned remainder of the prompt runs alone. A
        forward also ends at the request's branch point (`CheckpointPolicy.branch_points`)."""
        req, hb = self.requests[rid], self.layout.hash_block_tokens
        aligned_end = req.num_tokens // hb * hb
        end = min(req.num_computed + budget, req.num_tokens)
        if req.num_computed < req.branch_point < end:
            end = req.branch_point
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
        need = -(-(req.num_computed + num_new_tokens) // self._tokens_per_block) - len(req.blocks)
        if need > 0:
            groups = self.layout.num_mla_groups
            if need * groups > self.pool.num_available:
                raise OutOfPages(f"request {rid!r} needs {need} more blocks")
            for pages in self.pool.allocate_sets(PageKind.MLA, groups, need):
                req.blocks.append(Block(len(req.blocks), pages, self.tiering.evict_block))
        req.scheduled = num_new_tokens

    def batch_view(self, rids: Sequence[str]) -> PagedBatchCache:
        if self.store is None:
            raise RuntimeError("metadata-only manager has no tensors to view")
        return PagedBatchCache(self.store, [self.requests[r] for r in rids])

    def pre_forward(self) -> list[CopyOp]:
        """Run (with a store) and return the copies that must land before this step's forward."""
        return self.queue.run_pre(self.store)

    def forward_done(self, rid: str) -> None:
        """The forward over the reserved tokens ran: register the hash blocks it completed and snapshot
        the KDA state if it ended on a hash boundary. Both stay pending until `commit_step`."""
        req = self.requests[rid]
        if req.scheduled <= 0:
            raise ValueError(f"request {rid!r} has no reserved tokens")
        hb = self._hash_block
        start = req.num_computed
        end = req.num_computed = start + req.scheduled
        req.scheduled = 0
        self.queue.touched.add(rid)
        if end // hb > start // hb:  # hash blocks completed (a decode step mostly completes none)
            self._register(req, start // hb, min(end // hb, len(req.chain)))
        if end % hb == 0:
            self.snapshots.take(req)

    def _register(self, req: CachedRequest, first: int, last: int) -> None:
        """Register the endpoints of hash blocks [first, last) of a request (pending until commit)."""
        per_block = self._hash_blocks_per_block
        for j in range(first, last):
            block = req.blocks[j // per_block]
            covered = j % per_block + 1
            block.filled = covered
            self.index.register(req.chain[j], block, covered)
            if self.pool.owner[block.pages[0]] is None:
                self.retention.adopt(block.pages, block)

    def drop_checkpoint(self, checkpoint: Checkpoint) -> None:
        """Unregister a checkpoint in every group at once and release its pages (no write-back)."""
        self.snapshots.drop(checkpoint)

    # ---- step end -------------------------------------------------------------------------------------
    def commit_step(self) -> None:
        """This step's copies and forward have landed: make its registrations matchable, drop its pins."""
        queue = self.queue
        if queue.pre_ops or queue.zero_pages:
            self.pre_forward()
        if self.store is not None:
            self.store.run(queue.post_ops)
            pending = self.checkpoints.pending()
            if pending:
                # Queued behind this step's forward and snapshot copies, not waited for: the values reach the
                # checkpoints when first read (`settle_fingerprints`), the forward long done by then.
                self.settle_fingerprints()
                pages = [p for c in pending for p in c.pages]
                self._unsettled.append((pending, self.store.fingerprints_later(pages, self.layout.kda_page_used_bytes)))
        self.checkpoints.commit()
        self.index.commit()
        queue.release(self.pool)
        if self.metrics is not None:
            self.metrics.checkpoint_bytes.set(self.checkpoints.num_pages * self.layout.page_bytes)

    def settle_fingerprints(self) -> None:
        """Give the checkpoints committed so far their fingerprints (`Checkpoint.fingerprints`), waiting for
        the device if their checksum is still running. Called before anything reads them (the tiering's
        restore check and write-back) and by the next commit: the values are the ones the checksum took at
        the commit, wherever in between they are set."""
        unsettled, self._unsettled = self._unsettled, []
        for checkpoints, pending in unsettled:
            prints = iter(pending.result())
            for checkpoint in checkpoints:
                checkpoint.fingerprints = [next(prints) for _ in checkpoint.pages]

    def finish(self, rid: str, turn_boundary: bool = True) -> None:
        """Release a finished (or aborted, `turn_boundary=False`) request. Its latest checkpoint is the
        state at the last hash boundary of the conversation so far: kept for the next turn, together with
        the conversation's waypoints, and the checkpoint this turn started from is superseded by it."""
        req = self.requests.pop(rid)
        latest = req.latest
        if turn_boundary and latest is not None and self.checkpoints.by_key.get(latest.key) is latest:
            latest.keep = True
            resident = self.checkpoints.by_key
            latest.waypoints = [w for w in req.waypoints if w is not latest and resident.get(w.key) is w]
            # touched after the turn end, the shallowest last: the conversation leaves tail first
            for checkpoint in [latest, *reversed(latest.waypoints)]:
                if resident.get(checkpoint.key) is checkpoint:
                    self.checkpoints.touch(checkpoint)
                    for page in checkpoint.pages:
                        self.pool.touch(page)
            started = req.hit_checkpoint
            if (started is not None and started is not latest and started.num_tokens < latest.num_tokens
                    and not started.structural):  # waypoints and branch points stay what they are
                self.retention.supersede(started)
        # Tail blocks first, so that under LRU a prefix's end is evicted before its shared head.
        pages = [p for block in reversed(req.blocks) for p in block.pages] + req.state_pages
        if rid in self.queue.touched:
            self.queue.hold(pages)  # this step's copies may still read or write them
        else:
            for page in pages:
                self.pool.decref(page)

    def evict_idle(self, num_pages: int) -> int:
        """Evict idle cached entries (in retention order; written back to the CPU tier when there is one)
        until `num_pages` pages are free or nothing idle is left. Returns the pages freed."""
        freed = 0
        while freed < num_pages and self.pool.num_cached:
            freed += self.pool.evict_one()
        return freed
