"""The work of one scheduling step that has not landed yet, and the page references held until it has.

Copies queued before the forward (restore of a hit checkpoint, copy-on-write of a partial block, prefetch
from the host tier, zeroing of a fresh state) and after it (KDA snapshots) land with the step. Until
`commit` every page those copies read or write keeps a reference, so it can neither be evicted nor handed
to another request while a copy still targets it; the same holds for the pages of a request that is
finished in the step it was admitted or forwarded in.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from k3core.cache.checkpoints import Checkpoint
from k3core.cache.cpu_tier import HostEntry
from k3core.cache.page_store import CopyOp, PageStore
from k3core.cache.pool import PagePool


@dataclass
class StepQueue:
    pre_ops: list[CopyOp] = field(default_factory=list)  # land before the forward
    zero_pages: list[int] = field(default_factory=list)  # fresh private states (a miss), before pre_ops
    post_ops: list[CopyOp] = field(default_factory=list)  # snapshots, after the forward
    held_pages: list[int] = field(default_factory=list)  # one reference each, dropped at commit
    pinned_checkpoints: list[Checkpoint] = field(default_factory=list)
    pinned_host: list[HostEntry] = field(default_factory=list)
    touched: set[str] = field(default_factory=set)  # requests admitted or forwarded in this step

    @property
    def open(self) -> bool:
        return bool(self.pre_ops or self.zero_pages or self.post_ops or self.held_pages or self.pinned_host
                    or self.touched)

    def pin(self, pool: PagePool, pages: list[int]) -> None:
        """Reference `pages` until this step commits."""
        for page in pages:
            pool.incref(page)
        self.held_pages += pages

    def hold(self, pages: list[int]) -> None:
        """Keep a reference the caller already holds on `pages` (an allocation's, a finished request's)
        until this step commits."""
        self.held_pages += pages

    def run_pre(self, store: PageStore | None) -> list[CopyOp]:
        """Run (with a store) and return the copies due before the forward: zeroing first, then the copies,
        which may target a page zeroed for an earlier owner in the same step."""
        ops, self.pre_ops = self.pre_ops, []
        if store is not None:
            for page in self.zero_pages:
                store.zero(page)
            store.run(ops)
        self.zero_pages = []
        return ops

    def release(self, pool: PagePool) -> None:
        """The step has landed: drop every reference and pin taken for it."""
        for page in self.held_pages:
            pool.decref(page)
        for checkpoint in self.pinned_checkpoints:
            checkpoint.pins -= 1
        for entry in self.pinned_host:
            entry.pins -= 1
        self.held_pages, self.pinned_checkpoints, self.pinned_host = [], [], []
        self.post_ops = []
        self.touched.clear()
