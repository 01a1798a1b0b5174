"""The MLA prefix index: chain hash of a hash-block endpoint -> the physical block that holds it.

A physical block (one page per MLA group) spans `hash_blocks_per_block` fine hash blocks. Every endpoint
of a hash block that has been computed is registered under its chain hash, so a partially filled page is
findable at its last full hash block and the registration advances as the page fills. Registrations made
in the current scheduling step stay invisible to lookups until `commit` (their bytes land with the forward).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass(eq=False)
class Block:
    """One physical MLA block: `pages[g]` for MLA group g, in the block table of one or more requests."""

    index: int  # position in the token sequence: tokens [index*T, (index+1)*T)
    pages: list[int]
    on_evict: Callable[[Block], None]
    # (chain hash, hash blocks covered) this block answers lookups for
    endpoints: list[tuple[int, int]] = field(default_factory=list)
    # chain hashes this block also holds but another block answers for (it is a copy-on-write copy, or
    # recomputed a prefix someone else registered first); it takes over if that block is evicted
    standby: list[int] = field(default_factory=list)
    filled: int = 0  # hash blocks of this block whose bytes are valid (the first `filled`)
    anchors: int = 0  # checkpoints whose prefix lookups resolve through this block (retention)

    @property
    def last_endpoint(self) -> int:
        return max(self.endpoints, key=lambda e: e[1])[0]

    def evict(self) -> None:
        self.on_evict(self)


@dataclass(eq=False, slots=True)
class Endpoint:
    block: Block
    hash_blocks: int  # hash blocks of `block` covered by this endpoint (1..hash_blocks_per_block)
    ready: bool


class PrefixIndex:
    def __init__(self) -> None:
        self._by_hash: dict[int, Endpoint] = {}
        self._pending: list[Endpoint] = []
        self._standby: dict[int, list[Endpoint]] = {}

    def __len__(self) -> int:
        return len(self._by_hash)

    def find(self, chain_hash: int) -> Endpoint | None:
        """The committed endpoint with this chain hash, if any."""
        endpoint = self._by_hash.get(chain_hash)
        return endpoint if endpoint is not None and endpoint.ready else None

    def contains(self, chain_hash: int) -> bool:
        return chain_hash in self._by_hash

    def answering(self, chain_hash: int) -> Block | None:
        """The block that answers (or, once committed, will answer) lookups for this hash."""
        endpoint = self._by_hash.get(chain_hash)
        return endpoint.block if endpoint is not None else None

    def register(self, chain_hash: int, block: Block, hash_blocks: int) -> None:
        """Register an endpoint (pending until commit). If another block holds the hash already, this one
        is kept on standby for it: the first copy answers lookups until it is evicted."""
        endpoint = Endpoint(block, hash_blocks, ready=False)
        self._pending.append(endpoint)
        if chain_hash in self._by_hash:
            self._standby.setdefault(chain_hash, []).append(endpoint)
            block.standby.append(chain_hash)
        else:
            self._by_hash[chain_hash] = endpoint
            block.endpoints.append((chain_hash, hash_blocks))

    def commit(self) -> None:
        for endpoint in self._pending:
            endpoint.ready = True
        self._pending.clear()

    def unregister(self, block: Block) -> None:
        """Remove a block (evicted); a standby copy takes over each hash it answered for."""
        for chain_hash in block.standby:
            waiting = [e for e in self._standby.get(chain_hash, []) if e.block is not block]
            self._set_standby(chain_hash, waiting)
        for chain_hash, _ in block.endpoints:
            endpoint = self._by_hash.get(chain_hash)
            if endpoint is None or endpoint.block is not block:
                continue
            del self._by_hash[chain_hash]
            waiting = self._standby.get(chain_hash, [])
            if waiting:
                heir = waiting.pop(0)
                self._by_hash[chain_hash] = heir
                heir.block.standby.remove(chain_hash)
                heir.block.endpoints.append((chain_hash, heir.hash_blocks))
                self._set_standby(chain_hash, waiting)
        block.endpoints.clear()
        block.standby.clear()

    def _set_standby(self, chain_hash: int, waiting: list[Endpoint]) -> None:
        if waiting:
            self._standby[chain_hash] = waiting
        else:
            self._standby.pop(chain_hash, None)

    def items(self) -> list[tuple[int, Endpoint]]:
        return list(self._by_hash.items())
