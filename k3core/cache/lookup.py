"""Two-phase prefix lookup over the GPU pool and the CPU tier (K3 report §5.4.1, figure 12).

Phase 1 (MLA) walks the physical blocks of the request by the chain hash of each block's last hash block;
at the first block that does not match whole, it falls back to the longest hash endpoint inside it, so a
partially filled page still hits. Phase 2 (KDA) walks hash boundaries down from the phase-1 end until one has
a checkpoint (a checkpoint exists in every KDA group or in none). The hit is that boundary: a multiple of the
hash block, never required to be a multiple of the physical block.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from k3core.cache.checkpoints import Checkpoint, CheckpointStore
from k3core.cache.cpu_tier import CpuTier, HostBlock, HostCheckpoint
from k3core.cache.prefix_index import Block, PrefixIndex

BlockSource = Block | HostBlock
CheckpointSource = Checkpoint | HostCheckpoint


@dataclass
class Hit:
    num_tokens: int = 0  # the boundary B; 0 is a miss
    mla_tokens: int = 0  # how far phase 1 matched
    blocks: list[BlockSource] = field(default_factory=list)  # sources of blocks 0..ceil(B/T)-1
    checkpoint: CheckpointSource | None = None


@dataclass
class PrefixLookup:
    index: PrefixIndex
    checkpoints: CheckpointStore
    cpu: CpuTier | None
    hash_block_tokens: int
    hash_blocks_per_block: int

    def _block(self, chain_hash: int) -> BlockSource | None:
        endpoint = self.index.find(chain_hash)
        if endpoint is not None:
            return endpoint.block
        if self.cpu is not None:
            found = self.cpu.find_endpoint(chain_hash)
            if found is not None:
                return found[0]
        return None

    def _checkpoint(self, key: int) -> CheckpointSource | None:
        checkpoint = self.checkpoints.find(key)
        if checkpoint is None and self.cpu is not None:
            return self.cpu.find_checkpoint(key)
        return checkpoint

    def lookup(self, chain: list[int], num_tokens: int) -> Hit:
        """Longest reusable prefix of a sequence with these chain hashes and `num_tokens` tokens. At least
        one token is always left to compute (its logits are needed)."""
        per_block = self.hash_blocks_per_block
        limit = min(len(chain), (num_tokens - 1) // self.hash_block_tokens)
        full: list[BlockSource] = []
        matched = 0
        while matched + per_block <= limit:
            source = self._block(chain[matched + per_block - 1])
            if source is None:
                break
            full.append(source)
            matched += per_block
        partial: BlockSource | None = None
        for end in range(min(matched + per_block - 1, limit), matched, -1):
            partial = self._block(chain[end - 1])
            if partial is not None:
                matched = end
                break
        hit = Hit(mla_tokens=matched * self.hash_block_tokens)
        for end in range(matched, 0, -1):
            checkpoint = self._checkpoint(chain[end - 1])
            if checkpoint is None:
                continue
            whole, rest = divmod(end, per_block)
            hit.blocks = full[:whole]
            if rest:
                hit.blocks.append(full[whole] if whole < len(full) else partial)
            hit.num_tokens = end * self.hash_block_tokens
            hit.checkpoint = checkpoint
            break
        return hit
