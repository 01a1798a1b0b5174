"""Taking and dropping KDA checkpoints as requests advance (the policy of `CheckpointPolicy`).

After a forward that ends on a hash boundary, the request's private KDA state is copied into freshly
allocated pages (one per KDA group) and registered under the boundary's chain hash; the copy lands with
the step (`StepQueue.post_ops`) and the checkpoint is matchable only after `commit_step`. A request's
previous checkpoint is reclaimed when it takes the next one unless it was kept (a turn boundary, the
prompt's end, or a waypoint of a long prefill).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from k3core.cache.checkpoints import Checkpoint
from k3core.cache.page_store import CopyOp
from k3core.cache.pool import PageKind
from k3core.cache.request import CachedRequest

if TYPE_CHECKING:
    from k3core.cache.manager import PrefixCacheManager


class Snapshots:
    def __init__(self, manager: PrefixCacheManager) -> None:
        self.m = manager

    def take(self, req: CachedRequest) -> None:
        """Snapshot the request's state at its current (hash-aligned) position, if the policy wants one."""
        m, hb = self.m, self.m.layout.hash_block_tokens
        end = req.num_computed // hb
        if end > len(req.chain) or end % m.policy.every_hash_blocks:
            return
        key = req.chain[end - 1]
        previous = req.latest
        reclaim = (previous is not None and m.policy.supersede and previous.owner == req.rid
                   and not previous.keep and previous.key != key)
        checkpoint = m.checkpoints.by_key.get(key)
        if checkpoint is None:
            checkpoint = self._new(req, key, previous if reclaim else None)
            if checkpoint is None:
                return
        checkpoint.keep |= end == req.prompt_tokens // hb and m.policy.keep_prompt_end
        if req.num_computed == req.branch_point:
            checkpoint.keep = checkpoint.structural = True  # a shared prefix ends here
        spacing = m.policy.waypoint_tokens
        if spacing and req.num_computed < req.prompt_tokens:
            last = req.waypoints[-1].num_tokens if req.waypoints else req.hit_tokens
            if req.num_computed - last >= spacing and checkpoint not in req.waypoints:
                checkpoint.keep = checkpoint.structural = True  # a waypoint: evicted after the turn end
                checkpoint.waypoints = list(req.waypoints)  # a hit here resumes the conversation's lineage
                req.waypoints.append(checkpoint)
        req.latest = checkpoint
        if reclaim and previous is not None:
            self.drop(previous)

    def _new(self, req: CachedRequest, key: int, superseded: Checkpoint | None) -> Checkpoint | None:
        m = self.m
        groups = m.layout.num_kda_groups
        victims = m.checkpoints.victims_for(groups)
        if victims is None or groups > m.pool.num_available:
            if m.metrics is not None:
                m.metrics.checkpoints_skipped.inc()
            return None
        for victim in victims:
            m.tiering.evict_checkpoint(victim)
        pages = m.pool.allocate_sets(PageKind.KDA, groups, 1)[0]
        checkpoint = Checkpoint(key, req.num_computed, pages, req.chain, m.tiering.evict_checkpoint,
                                owner=req.rid)
        m.checkpoints.add(checkpoint)
        m.retention.adopt(pages, checkpoint)
        m.retention.anchor(checkpoint, superseded)  # the request's previous one goes next: anchors move over
        nbytes = m.layout.kda_page_used_bytes
        m.queue.post_ops += [CopyOp(dst, nbytes, src_page=src) for dst, src in zip(pages, req.state_pages, strict=True)]
        m.queue.hold(pages)  # the allocation reference holds the pages until the copy lands
        return checkpoint

    def drop(self, checkpoint: Checkpoint) -> None:
        """Unregister a checkpoint in every group at once and release its pages (no write-back)."""
        m = self.m
        if m.checkpoints.by_key.get(checkpoint.key) is not checkpoint:
            return  # already evicted
        m.checkpoints.remove(checkpoint)
        m.retention.release(checkpoint)
        checkpoint.waypoints = []  # an evicted turn end no longer keeps its conversation's others alive
        for page in checkpoint.pages:
            m.pool.release(page)
