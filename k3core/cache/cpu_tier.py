"""The CPU-DRAM tier: a write-back pool for idle prefixes evicted from the GPU (K3 report §5.3.1).

Entries arrive only when the GPU evicts them (write-back, never write-through), so DRAM and copy bandwidth
are spent only on prefixes that left the active decode path. MLA blocks are found by the same chain hashes
as on the GPU, checkpoints by their boundary key. Each entry keeps the fingerprint of its bytes; a prefetch
checks it. Without a page store (metadata-only use) entries carry sizes but no bytes.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

import torch

from k3core.cache.hashing import checksums


@dataclass(eq=False)
class HostEntry:
    """Bytes of one GPU entry on the host: an MLA block (one tensor per MLA group) or a checkpoint (one per
    KDA group)."""

    key: int  # last endpoint hash (block) or boundary key (checkpoint)
    num_bytes: int
    data: list[torch.Tensor] | None
    fingerprints: list[int] | None
    pins: int = 0

    def verified(self) -> bool:
        if self.data is None or self.fingerprints is None:
            return True
        return checksums(self.data) == self.fingerprints


@dataclass(eq=False)
class HostBlock(HostEntry):
    index: int = 0  # physical block position
    endpoints: list[tuple[int, int]] = field(default_factory=list)  # (chain hash, hash blocks covered)
    filled: int = 0  # hash blocks of the block held in `data`


@dataclass(eq=False)
class HostCheckpoint(HostEntry):
    num_tokens: int = 0


class CpuTier:
    def __init__(self, capacity_bytes: int) -> None:
        self.capacity_bytes = capacity_bytes
        self.used_bytes = 0
        self._endpoints: dict[int, tuple[HostBlock, int]] = {}  # chain hash -> (block, hash blocks covered)
        self._checkpoints: dict[int, HostCheckpoint] = {}
        self._lru: OrderedDict[int, HostEntry] = OrderedDict()  # id(entry) -> entry, oldest first
        self.dropped = 0

    # ---- lookup ---------------------------------------------------------------------------------------
    def find_endpoint(self, chain_hash: int) -> tuple[HostBlock, int] | None:
        return self._endpoints.get(chain_hash)

    def find_checkpoint(self, key: int) -> HostCheckpoint | None:
        return self._checkpoints.get(key)

    def has_block(self, last_endpoint: int) -> bool:
        return last_endpoint in self._endpoints

    # ---- insertion ------------------------------------------------------------------------------------
    def _make_room(self, num_bytes: int) -> bool:
        if num_bytes > self.capacity_bytes:
            return False
        for entry in list(self._lru.values()):
            if self.used_bytes + num_bytes <= self.capacity_bytes:
                break
            if entry.pins == 0:
                self.remove(entry)
                self.dropped += 1
        return self.used_bytes + num_bytes <= self.capacity_bytes

    def put_block(self, block: HostBlock) -> bool:
        """Insert a block under the endpoints the tier does not hold yet (a prefix it holds already, e.g. a
        shared system prompt inside this block, stays with its first copy). False if nothing is new."""
        new = [(h, covered) for h, covered in block.endpoints if h not in self._endpoints]
        if not new or not self._make_room(block.num_bytes):
            return False
        for chain_hash, covered in new:
            self._endpoints[chain_hash] = (block, covered)
        self._insert(block)
        return True

    def put_checkpoint(self, checkpoint: HostCheckpoint) -> bool:
        if checkpoint.key in self._checkpoints or not self._make_room(checkpoint.num_bytes):
            return False
        self._checkpoints[checkpoint.key] = checkpoint
        self._insert(checkpoint)
        return True

    def _insert(self, entry: HostEntry) -> None:
        self._lru[id(entry)] = entry
        self.used_bytes += entry.num_bytes

    def touch(self, entry: HostEntry) -> None:
        if id(entry) in self._lru:
            self._lru.move_to_end(id(entry))

    def remove(self, entry: HostEntry) -> None:
        if self._lru.pop(id(entry), None) is None:
            return
        self.used_bytes -= entry.num_bytes
        if isinstance(entry, HostBlock):
            for chain_hash, _ in entry.endpoints:
                if self._endpoints.get(chain_hash, (None,))[0] is entry:
                    del self._endpoints[chain_hash]
        elif isinstance(entry, HostCheckpoint):
            self._checkpoints.pop(entry.key, None)

    def blocks(self) -> list[HostBlock]:
        return [e for e in self._lru.values() if isinstance(e, HostBlock)]

    def checkpoints(self) -> list[HostCheckpoint]:
        return list(self._checkpoints.values())
