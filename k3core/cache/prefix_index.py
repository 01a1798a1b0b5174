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
    # (chain hash, hash blocks covered) registered for this block, in order; a prefix already registered
    # by another block (this one is its copy-on-write copy) is not repeated here
    endpoints: list[tuple[int, int]] = field(default_factory=list)
    filled: int = 0  # hash blocks of this block whose bytes are valid (the first `filled`)

    @property
    def registered(self) -> bool:
        return bool(self.endpoints)

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

    def __len__(self) -> int:
        return len(self._by_hash)

    def find(self, chain_hash: int) -> Endpoint | None:
        """The committed endpoint with this chain hash, if any."""
        endpoint = self._by_hash.get(chain_hash)
        return endpoint if endpoint is not None and endpoint.ready else None

    def contains(self, chain_hash: int) -> bool:
        return chain_hash in self._by_hash

    def register(self, chain_hash: int, block: Block, hash_blocks: int) -> bool:
        """Register an endpoint (pending until commit). A hash already held by another block is kept there:
        the first copy of a prefix stays the canonical one. Returns whether the endpoint was added."""
        if chain_hash in self._by_hash:
            return False
        endpoint = Endpoint(block, hash_blocks, ready=False)
        self._by_hash[chain_hash] = endpoint
        self._pending.append(endpoint)
        block.endpoints.append((chain_hash, hash_blocks))
        return True

    def commit(self) -> None:
        for endpoint in self._pending:
            endpoint.ready = True
        self._pending.clear()

    def unregister(self, block: Block) -> None:
        for chain_hash, _ in block.endpoints:
            endpoint = self._by_hash.get(chain_hash)
            if endpoint is not None and endpoint.block is block:
                del self._by_hash[chain_hash]
        block.endpoints.clear()

    def items(self) -> list[tuple[int, Endpoint]]:
        return list(self._by_hash.items())
