"""Which idle cache entries go first when the pool needs pages: a cost-aware order for conversations.

A checkpoint is reusable only together with every MLA block of its prefix, and a conversation's next turn
extends its last one. So an idle MLA block is worth keeping only while some checkpoint's prefix runs
through it, and a turn-boundary checkpoint that the next turn of its conversation built on is worth little
(only a branch from that turn would use it). With `CheckpointPolicy(eviction="value")` the pool keeps one
LRU per tier and evicts from the lowest non-empty tier:

    WORTHLESS   blocks no checkpoint anchors: past the last checkpoint of their sequence (the rest of a
                conversation whose checkpoint went), or duplicates that answer no lookup (a recompute of a
                prefix that another block already answers for)
    SUPERSEDED  turn-boundary checkpoints that a later turn of their conversation ended on top of
    CHECKPOINT  every other checkpoint: evicting one makes the blocks only it anchored WORTHLESS, so a
                conversation leaves as a whole, least recently used first
    ANCHORED    blocks some checkpoint's prefix runs through: evicted only when nothing else is idle

A checkpoint anchors the blocks that a lookup of its prefix resolves to (the block answering the last hash
of each physical block), counted per block. With "lru" every entry shares one tier (one LRU, the way vLLM
evicts; the benchmark's block-grid peer).
"""

from __future__ import annotations

from enum import IntEnum

from k3core.cache.checkpoints import Checkpoint
from k3core.cache.layout import PoolLayout
from k3core.cache.pool import PagePool
from k3core.cache.prefix_index import Block, PrefixIndex


class Retention(IntEnum):
    WORTHLESS = 0
    SUPERSEDED = 1
    CHECKPOINT = 2
    ANCHORED = 3


class RetentionPolicy:
    def __init__(self, pool: PagePool, index: PrefixIndex, layout: PoolLayout, value_aware: bool) -> None:
        self.pool = pool
        self.index = index
        self.value_aware = value_aware
        self.hash_block = layout.hash_block_tokens
        self.per_block = layout.hash_blocks_per_block

    @staticmethod
    def num_tiers(value_aware: bool) -> int:
        return len(Retention) if value_aware else 1

    def block_tier(self, block: Block) -> int:
        if not self.value_aware:
            return 0
        return Retention.ANCHORED if block.anchors else Retention.WORTHLESS

    def checkpoint_tier(self, checkpoint: Checkpoint) -> int:
        if not self.value_aware:
            return 0
        return Retention.SUPERSEDED if checkpoint.superseded else Retention.CHECKPOINT

    def adopt(self, pages: list[int], owner: Block | Checkpoint) -> None:
        """Make `pages` part of a cache entry, in the entry's tier."""
        tier = self.block_tier(owner) if isinstance(owner, Block) else self.checkpoint_tier(owner)
        for page in pages:
            self.pool.adopt(page, owner, tier)

    # ---- anchors --------------------------------------------------------------------------------------
    def anchor(self, checkpoint: Checkpoint, inherit: Checkpoint | None = None) -> None:
        """Count the prefix blocks of a new checkpoint. `inherit`: an earlier checkpoint of the same sequence
        that is being dropped for this one; its anchors move over and only the blocks from its last one on
        are resolved (that last block may answer differently now that it is fuller)."""
        if not self.value_aware:
            return
        blocks: list[Block] = []
        replaced: Block | None = None
        if inherit is not None and inherit.anchored:
            blocks, inherit.anchored = inherit.anchored, []
            replaced = blocks.pop()
        ends = checkpoint.num_tokens // self.hash_block
        for k in range(len(blocks), -(-ends // self.per_block)):
            block = self.index.answering(checkpoint.chain[min((k + 1) * self.per_block, ends) - 1])
            if block is None:  # not on the GPU (a prefetch staged only whole blocks): lookups stop here
                break
            blocks.append(block)
            self._count(block, +1)
        if replaced is not None:
            self._count(replaced, -1)
        checkpoint.anchored = blocks

    def release(self, checkpoint: Checkpoint) -> None:
        """The checkpoint is gone: its blocks lose its anchor."""
        blocks, checkpoint.anchored = checkpoint.anchored, []
        for block in blocks:
            self._count(block, -1)

    def _count(self, block: Block, delta: int) -> None:
        block.anchors += delta
        if block.anchors == (1 if delta > 0 else 0) and self.pool.owner[block.pages[0]] is block:
            tier = self.block_tier(block)  # changed between WORTHLESS and ANCHORED
            for page in block.pages:
                self.pool.set_tier(page, tier)

    def supersede(self, checkpoint: Checkpoint) -> None:
        """A later turn of the checkpoint's conversation has ended: evict it before live conversations."""
        if checkpoint.superseded or self.pool.owner[checkpoint.pages[0]] is not checkpoint:
            return
        checkpoint.superseded = True
        for page in checkpoint.pages:
            self.pool.set_tier(page, self.checkpoint_tier(checkpoint))
