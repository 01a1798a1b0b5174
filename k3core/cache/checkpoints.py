"""KDA checkpoints: read-only snapshots of the recurrent state at hash-aligned boundaries.

A checkpoint is one page per KDA cache group, all taken at the same boundary and registered under the
chain hash of the boundary's last hash block. It is one entry: evicting any of its pages evicts all of them
and removes the key, so a checkpoint is hittable in every group or in none. A snapshot is always written
into freshly allocated pages; a registered checkpoint is never written again.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

from k3core.cache.prefix_index import Block


@dataclass(frozen=True)
class CheckpointPolicy:
    """Which boundaries get a checkpoint and how much of the pool checkpoints may hold.

    every_hash_blocks: snapshot only where the boundary (in hash blocks) is a multiple of this.
    supersede: a request's previous checkpoint is reclaimed when it takes a new one, unless it was kept
        (turn boundary); False keeps every snapshot until eviction (what a block-grid cache does).
    max_pool_fraction: cap on the pages held by checkpoints; superseded turn boundaries go first, then the
        least recently used.
    keep_prompt_end: keep the checkpoint at the last boundary of the prompt (resampling, retries).
    waypoint_tokens: during a prefill, keep a checkpoint every this many computed tokens (0: none). A
        conversation's waypoints are evicted after its turn end, deepest first, so memory pressure trims a
        long conversation from its tail (its head stays reusable) instead of losing all of it at once.
    branch_points: when a prompt's MLA match runs past its checkpoint hit (a prefix another sequence
        computed, such as a shared system prompt), `prefill_chunk` ends a forward at the end of the match
        and the checkpoint taken there is kept, so the next sequence sharing that prefix hits it.
    eviction: "value" evicts idle entries in the cost-aware order of `k3core.cache.retention` (what no
        checkpoint can use, superseded turn boundaries, then whole conversations least recently used
        first); "lru" keeps one LRU over every entry (a vLLM-style cache).
    """

    every_hash_blocks: int = 1
    supersede: bool = True
    max_pool_fraction: float = 0.25
    keep_prompt_end: bool = True
    eviction: str = "value"
    waypoint_tokens: int = 65_536
    branch_points: bool = True

    def __post_init__(self) -> None:
        if self.eviction not in ("value", "lru"):
            raise ValueError(f"eviction must be 'value' or 'lru', not {self.eviction!r}")
        if self.every_hash_blocks < 1 or not 0 <= self.max_pool_fraction <= 1 or self.waypoint_tokens < 0:
            raise ValueError("every_hash_blocks must be >= 1, max_pool_fraction in [0, 1], waypoint_tokens >= 0")


@dataclass(eq=False)
class Checkpoint:
    key: int  # chain hash of the last hash block before the boundary
    num_tokens: int  # the boundary B
    pages: list[int]  # one per KDA group
    chain: list[int]  # chain hashes of the prefix (shared with the request that took it; read [:B/hb])
    on_evict: Callable[[Checkpoint], None]
    owner: str | None = None  # request that took it; it may reclaim it when superseded
    keep: bool = False  # turn boundary: survives supersession
    ready: bool = False  # bytes landed (committed)
    # per page, of the bytes at the commit; queued there and set before the first read (`settle_fingerprints`)
    fingerprints: list[int] | None = None
    pins: int = 0  # hits being restored from it
    superseded: bool = False  # a later turn of its conversation ended on top of it (evicted early)
    anchored: list[Block] = field(default_factory=list)  # prefix blocks it keeps worth holding (retention)
    waypoints: list[Checkpoint] = field(default_factory=list)  # a turn end's conversation waypoints
    structural: bool = False  # a waypoint or a branch point: never superseded by a turn built on it

    def evict(self) -> None:
        self.on_evict(self)

    def prefix_hashes(self, hash_block: int) -> list[int]:
        return self.chain[: self.num_tokens // hash_block]


@dataclass
class CheckpointStore:
    pages_per_checkpoint: int
    max_pages: int
    by_key: dict[int, Checkpoint] = field(default_factory=dict)
    _lru: OrderedDict[int, Checkpoint] = field(default_factory=OrderedDict)  # by key, oldest first
    _pending: list[Checkpoint] = field(default_factory=list)

    @property
    def num_pages(self) -> int:
        return len(self.by_key) * self.pages_per_checkpoint

    def find(self, key: int) -> Checkpoint | None:
        checkpoint = self.by_key.get(key)
        return checkpoint if checkpoint is not None and checkpoint.ready else None

    def add(self, checkpoint: Checkpoint) -> None:
        if checkpoint.key in self.by_key:
            raise KeyError(f"checkpoint {checkpoint.key:#x} exists; snapshots never overwrite")
        self.by_key[checkpoint.key] = checkpoint
        self._lru[checkpoint.key] = checkpoint
        self._pending.append(checkpoint)

    def pending(self) -> list[Checkpoint]:
        return [c for c in self._pending if self.by_key.get(c.key) is c]

    def commit(self) -> None:
        for checkpoint in self._pending:
            checkpoint.ready = True
        self._pending.clear()

    def remove(self, checkpoint: Checkpoint) -> None:
        if self.by_key.get(checkpoint.key) is checkpoint:
            del self.by_key[checkpoint.key]
            del self._lru[checkpoint.key]

    def touch(self, checkpoint: Checkpoint) -> None:
        if checkpoint.key in self._lru:
            self._lru.move_to_end(checkpoint.key)

    def victims_for(self, extra: int) -> list[Checkpoint] | None:
        """Unpinned, committed checkpoints to drop so that `extra` more fit the cap, superseded ones first,
        then least recently used; None when the cap cannot be met."""
        need = self.num_pages + extra - self.max_pages
        if need <= 0:
            return []
        victims: list[Checkpoint] = []
        for superseded in (True, False):
            for checkpoint in self._lru.values():
                if need <= 0:
                    return victims
                if checkpoint.superseded is superseded and checkpoint.ready and checkpoint.pins == 0:
                    victims.append(checkpoint)
                    need -= self.pages_per_checkpoint
        return victims if need <= 0 else None
