"""What the cache manager tracks for one running request."""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from dataclasses import dataclass, field

from k3core.cache.checkpoints import Checkpoint
from k3core.cache.hashing import extend_chain
from k3core.cache.prefix_index import Block


@dataclass(eq=False)
class CachedRequest:
    rid: str
    hash_block: int
    chain: list[int] = field(default_factory=list)  # chain hashes of the full hash blocks of known tokens
    tokens: array[int] | None = None  # int64; None when the caller supplies hashes (metadata-only use)
    num_tokens: int = 0  # tokens known: prompt plus generated so far
    prompt_tokens: int = 0
    num_computed: int = 0  # tokens whose KV and state are in the cache
    scheduled: int = 0  # new tokens reserved for the current step
    hit_tokens: int = 0
    branch_point: int = 0  # where its MLA match ended past its hit: a forward ends and a checkpoint is kept there
    blocks: list[Block] = field(default_factory=list)  # block table
    state_pages: list[int] = field(default_factory=list)  # private KDA state, one page per KDA group
    latest: Checkpoint | None = None  # most recent checkpoint taken at this request's position
    hit_checkpoint: Checkpoint | None = None  # the GPU checkpoint its prefix hit was restored from
    waypoints: list[Checkpoint] = field(default_factory=list)  # its conversation's, shallowest first

    def append_tokens(self, tokens: Sequence[int]) -> None:
        if self.tokens is None:
            raise ValueError(f"request {self.rid} was added by hashes; use append_hashes")
        self.tokens.extend(tokens)
        self.num_tokens = len(self.tokens)
        if self.num_tokens >= (len(self.chain) + 1) * self.hash_block:  # a hash block filled: hash it
            extend_chain(self.chain, self.tokens, self.hash_block)

    def append_hashes(self, num_new_tokens: int, chain_hashes: Sequence[int]) -> None:
        """Metadata-only growth: the caller hashes the new full hash blocks itself."""
        self.num_tokens += num_new_tokens
        self.chain.extend(chain_hashes)
        if len(self.chain) != self.num_tokens // self.hash_block:
            raise ValueError(f"request {self.rid}: {len(self.chain)} chain hashes for {self.num_tokens} tokens")
