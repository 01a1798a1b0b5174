"""Data movement between cache entries and tiers: restore, copy-on-write, CPU write-back and prefetch,
and the integrity checks on each path.

Write-back happens only on eviction from the GPU (the one eviction path of the pool calls `evict_block` /
`evict_checkpoint`): an evicted MLA block goes to the CPU tier; an evicted turn-boundary checkpoint goes
there together with the idle GPU blocks of its prefix that the tier lacks, so that KDA state and MLA KV
of a prefix leave (and come back) together. Blocks still referenced by a running request are never copied.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from k3core.cache.checkpoints import Checkpoint
from k3core.cache.cpu_tier import HostBlock, HostCheckpoint
from k3core.cache.lookup import BlockSource, CheckpointSource, Hit
from k3core.cache.page_store import CopyOp
from k3core.cache.pool import PageKind
from k3core.cache.prefix_index import Block

if TYPE_CHECKING:
    from k3core.cache.manager import PrefixCacheManager


class Tiering:
    def __init__(self, manager: PrefixCacheManager) -> None:
        self.m = manager
        self.lay = manager.layout
        self._children: dict[tuple[str, ...], Any] = {}

    def _count(self, name: str, amount: float = 1, **labels: str) -> None:
        metrics = self.m.metrics
        if metrics is not None:
            key = (name, *labels.values())
            child = self._children.get(key)
            if child is None:  # resolving labels costs more than the increment: keep the child
                metric = getattr(metrics, name)
                child = self._children[key] = metric.labels(**labels) if labels else metric
            child.inc(amount)

    # ---- integrity ------------------------------------------------------------------------------------
    def verify(self, hit: Hit) -> bool:
        """Check the fingerprints of what a hit is about to copy from; drop a corrupt entry (counted) and
        return False so the caller looks up again and gets a shorter hit or a miss."""
        for src in [*hit.blocks, hit.checkpoint]:
            if isinstance(src, HostBlock | HostCheckpoint) and not src.verified():
                self._integrity_error("prefetch")
                assert self.m.cpu is not None
                self.m.cpu.remove(src)
                return False
        checkpoint = hit.checkpoint
        store = self.m.store
        if isinstance(checkpoint, Checkpoint) and store is not None and self.m.verify_restore:
            self.m.settle_fingerprints()  # a checkpoint committed last step may not have them yet
            if (checkpoint.fingerprints is not None
                    and store.fingerprints(checkpoint.pages, self.lay.kda_page_used_bytes) != checkpoint.fingerprints):
                self._integrity_error("restore")
                self.m.drop_checkpoint(checkpoint)
                return False
        return True

    def _integrity_error(self, where: str) -> None:
        self.m.integrity_errors += 1
        self._count("integrity_errors", where=where)

    # ---- copies into fresh pages ----------------------------------------------------------------------
    def copy_block(self, index: int, src: BlockSource, pages: list[int], tokens: int) -> Block:
        """A new block at `index` whose first `tokens` tokens are copied from `src`. A whole block coming
        from the host is registered (pending) and shared; a partial one is the request's private copy."""
        block = Block(index, pages, self.evict_block, filled=tokens // self.lay.hash_block_tokens)
        nbytes = self.lay.mla_prefix_bytes(tokens)
        if isinstance(src, HostBlock):
            self._count("cpu_tier_bytes", nbytes * len(pages), direction="prefetch")
        if self.m.store is not None:
            for g, page in enumerate(pages):
                if isinstance(src, HostBlock):
                    assert src.data is not None
                    self.m.queue.pre_ops.append(CopyOp(page, nbytes, src_host=src.data[g]))
                else:
                    self.m.queue.pre_ops.append(CopyOp(page, nbytes, src_page=src.pages[g]))
        if isinstance(src, HostBlock) and tokens == self.lay.tokens_per_block:
            for chain_hash, covered in src.endpoints:
                self.m.index.register(chain_hash, block, covered)
            self.m.retention.adopt(pages, block)
        return block

    def restore(self, src: CheckpointSource, state_pages: list[int]) -> None:
        """Queue the copy of a checkpoint into a request's private state (before its next forward)."""
        nbytes = self.lay.kda_page_used_bytes
        if isinstance(src, HostCheckpoint):
            self._count("cpu_tier_bytes", src.num_bytes, direction="prefetch")
        if self.m.store is None:
            return
        for g, page in enumerate(state_pages):
            if isinstance(src, HostCheckpoint):
                assert src.data is not None
                self.m.queue.pre_ops.append(CopyOp(page, nbytes, src_host=src.data[g]))
            else:
                self.m.queue.pre_ops.append(CopyOp(page, nbytes, src_page=src.pages[g]))

    def prefetch(self, hit: Hit, chain: list[int]) -> int:
        """Stage the host-resident whole blocks and checkpoint of a hit on the GPU (pending until commit)."""
        lay, m = self.lay, self.m
        # Skip what an earlier prefetch of this step already staged (pending, so lookups do not see it).
        host_blocks = [(k, s) for k, s in enumerate(hit.blocks)
                       if isinstance(s, HostBlock) and (k + 1) * lay.tokens_per_block <= hit.num_tokens
                       and not m.index.contains(max(s.endpoints, key=lambda e: e[1])[0])]
        host_checkpoint = hit.checkpoint if isinstance(hit.checkpoint, HostCheckpoint) else None
        if host_checkpoint is not None and host_checkpoint.key in m.checkpoints.by_key:
            host_checkpoint = None
        needed = lay.num_mla_groups * len(host_blocks) + (lay.num_kda_groups if host_checkpoint else 0)
        if not needed or needed > m.pool.num_available or (
                host_checkpoint and m.checkpoints.victims_for(lay.num_kda_groups) != []):
            return 0
        m.admission.pin(hit)
        for k, src in host_blocks:
            pages = m.pool.allocate_sets(PageKind.MLA, lay.num_mla_groups, 1)[0]
            self.copy_block(k, src, pages, lay.tokens_per_block)
            m.queue.hold(pages)
        if host_checkpoint is not None:
            pages = m.pool.allocate_sets(PageKind.KDA, lay.num_kda_groups, 1)[0]
            checkpoint = Checkpoint(host_checkpoint.key, hit.num_tokens, pages, chain, self.evict_checkpoint,
                                    keep=True, fingerprints=host_checkpoint.fingerprints)
            m.checkpoints.add(checkpoint)
            m.retention.adopt(pages, checkpoint)
            m.retention.anchor(checkpoint)
            self.restore(host_checkpoint, pages)
            m.queue.hold(pages)
        return hit.num_tokens

    # ---- eviction and write-back ----------------------------------------------------------------------
    def evict_block(self, block: Block) -> None:
        m = self.m
        self._count("evictions", kind="mla")
        if m.cpu is not None and block.endpoints and not m.cpu.has_block(block.last_endpoint):
            self._write_back_block(block)
        m.index.unregister(block)
        for page in block.pages:
            m.pool.release(page)

    def evict_checkpoint(self, checkpoint: Checkpoint) -> None:
        m = self.m
        if m.checkpoints.by_key.get(checkpoint.key) is not checkpoint:
            return
        self._count("evictions", kind="kda")
        if m.cpu is not None and checkpoint.keep and checkpoint.ready:
            if self._write_back_checkpoint(checkpoint):
                self._write_back_prefix(checkpoint)
        m.drop_checkpoint(checkpoint)

    def _host_bytes(self, pages: list[int], nbytes: int, known: list[int] | None) -> tuple[
            list | None, list[int] | None, bool]:
        """(bytes, checksums, intact) of pages read for the host; checked against `known` first, if given, on
        the pool's device (`known` may come from the host tier: the checksum is the same on every device)."""
        store = self.m.store
        if store is None:
            return None, None, True
        prints = store.fingerprints(pages, nbytes)  # once, where the bytes are: the copies read below match
        if known is not None and prints != known:
            self._integrity_error("write_back")
            return None, None, False
        return [store.read(p, nbytes) for p in pages], prints, True

    def _write_back_block(self, block: Block) -> None:
        assert self.m.cpu is not None
        nbytes = self.lay.mla_prefix_bytes(block.filled * self.lay.hash_block_tokens)
        data, prints, _ = self._host_bytes(block.pages, nbytes, None)
        host = HostBlock(block.last_endpoint, nbytes * len(block.pages), data, prints, index=block.index,
                         endpoints=list(block.endpoints), filled=block.filled)
        if self.m.cpu.put_block(host):
            self._count("cpu_tier_bytes", host.num_bytes, direction="offload")

    def _write_back_checkpoint(self, checkpoint: Checkpoint) -> bool:
        assert self.m.cpu is not None
        nbytes = self.lay.kda_page_used_bytes
        self.m.settle_fingerprints()
        data, prints, intact = self._host_bytes(checkpoint.pages, nbytes, checkpoint.fingerprints)
        host = HostCheckpoint(checkpoint.key, nbytes * len(checkpoint.pages), data, prints,
                              num_tokens=checkpoint.num_tokens)
        if not intact or not self.m.cpu.put_checkpoint(host):
            return False
        self._count("cpu_tier_bytes", host.num_bytes, direction="offload")
        return True

    def _write_back_prefix(self, checkpoint: Checkpoint) -> None:
        """Write back the idle GPU blocks of a checkpoint's prefix that the CPU tier does not hold yet."""
        m, per_block = self.m, self.lay.hash_blocks_per_block
        chain = checkpoint.prefix_hashes(self.lay.hash_block_tokens)
        for end in range(per_block, len(chain) + per_block, per_block):
            endpoint = m.index.find(chain[min(end, len(chain)) - 1])
            if endpoint is None:
                continue
            block = endpoint.block
            idle = all(m.pool.refcount[p] == 0 for p in block.pages)
            assert m.cpu is not None
            if idle and block.endpoints and not m.cpu.has_block(block.last_endpoint):
                self._write_back_block(block)
