"""The page allocator: one free list, one refcount per page, one eviction path for every cache group.

Pages are in one of three states:
- in use: refcount > 0 (a running request's block/state, or pinned by a lookup hit or a pending copy);
- cached: refcount 0 but owned by a cache entry (a registered MLA block or a KDA checkpoint), kept so that
  a later hit can reuse it or reclaimed when memory runs out;
- free: refcount 0 and owned by nothing.

Cached pages sit in one LRU per retention tier (`k3core.cache.retention` decides the tier of an entry).
Allocation takes free pages first, then evicts the least recently used entry of the lowest non-empty tier.
Evicting a page calls its owner's `evict` once; the owner unregisters itself everywhere (that is how one
group's checkpoint page takes its sibling groups' pages with it) and hands all of its pages back with
`release`.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from enum import IntEnum
from typing import Protocol

_ABSENT = object()


class PageKind(IntEnum):
    FREE = 0
    MLA = 1
    KDA = 2


class OutOfPages(RuntimeError):
    """Not enough free or evictable pages; the scheduler should wait or preempt."""


class PageOwner(Protocol):
    def evict(self) -> None:
        """Unregister this entry and `release` all of its pages (called when one page is evicted)."""


class PagePool:
    def __init__(self, num_pages: int, num_tiers: int = 1) -> None:
        if num_pages <= 0:
            raise ValueError("num_pages must be positive")
        self.num_pages = num_pages
        self.refcount = [0] * num_pages
        self.kind = [PageKind.FREE] * num_pages
        self.group = [-1] * num_pages
        self.owner: list[PageOwner | None] = [None] * num_pages
        self.tier = [0] * num_pages  # retention tier the page is cached in when idle (lower goes first)
        self._free: deque[int] = deque(range(num_pages))
        # one LRU per tier: first = least recently used
        self._cached: list[OrderedDict[int, None]] = [OrderedDict() for _ in range(num_tiers)]
        self._num_cached = 0
        self.evictions = 0

    # ---- capacity -------------------------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_cached(self) -> int:
        return self._num_cached

    @property
    def num_available(self) -> int:
        return len(self._free) + self._num_cached

    def is_cached(self, page: int) -> bool:
        return page in self._cached[self.tier[page]]

    # ---- allocation -----------------------------------------------------------------------------------
    def allocate_sets(self, kind: PageKind, groups: int, count: int) -> list[list[int]]:
        """`count` page sets of one page per cache group (callers check availability first)."""
        per_group = [self.allocate(kind, g, count) for g in range(groups)]
        return [[per_group[g][i] for g in range(groups)] for i in range(count)]

    def allocate(self, kind: PageKind, group: int, count: int = 1) -> list[int]:
        """`count` pages with refcount 1, evicting cached entries (lowest tier, LRU first) when the free list
        is short."""
        if count > self.num_available:
            raise OutOfPages(f"need {count} pages, {self.num_available} free or evictable")
        while len(self._free) < count:
            self.evict_one()
        pages = [self._free.popleft() for _ in range(count)]
        for page in pages:
            self.refcount[page] = 1
            self.kind[page] = kind
            self.group[page] = group
        return pages

    def evict_one(self) -> int:
        """Evict the least recently used cached entry of the lowest non-empty tier; returns the pages freed."""
        lru = next((tier for tier in self._cached if tier), None)
        if lru is None:
            raise OutOfPages("nothing left to evict")
        page = next(iter(lru))
        owner = self.owner[page]
        before = len(self._free)
        assert owner is not None, f"cached page {page} has no owner"
        owner.evict()
        self.evictions += 1
        if self.owner[page] is not None:
            raise RuntimeError(f"owner of page {page} did not release it on eviction")
        return len(self._free) - before

    # ---- references -----------------------------------------------------------------------------------
    def incref(self, page: int) -> None:
        if self.refcount[page] == 0:
            if self.kind[page] == PageKind.FREE:
                raise RuntimeError(f"incref of free page {page}")
            self._uncache(page)
        self.refcount[page] += 1

    def decref(self, page: int) -> None:
        count = self.refcount[page] - 1
        if count < 0:
            raise RuntimeError(f"refcount of page {page} below zero")
        self.refcount[page] = count
        if count == 0:
            if self.owner[page] is None:
                self._to_free(page)
            else:
                self._cache(page)

    def touch(self, page: int) -> None:
        """Mark a cached page most recently used in its tier."""
        lru = self._cached[self.tier[page]]
        if page in lru:
            lru.move_to_end(page)

    def set_tier(self, page: int, tier: int) -> None:
        """Move a page to another retention tier (as its most recently used entry if it is cached)."""
        if self.tier[page] == tier:
            return
        cached = self._uncache(page)
        self.tier[page] = tier
        if cached:
            self._cache(page)

    # ---- ownership by cache entries -------------------------------------------------------------------
    def adopt(self, page: int, owner: PageOwner, tier: int = 0) -> None:
        """Make `page` part of a cache entry: at refcount 0 it stays cached instead of being freed."""
        if self.owner[page] is not None:
            raise RuntimeError(f"page {page} already has an owner")
        self.owner[page] = owner
        self.tier[page] = tier
        if self.refcount[page] == 0:
            self._cache(page)

    def release(self, page: int) -> None:
        """Drop the owner of `page`; it becomes free once no request references it."""
        self.owner[page] = None
        if self.refcount[page] == 0:
            self._uncache(page)
            self._to_free(page)

    def _cache(self, page: int) -> None:
        self._cached[self.tier[page]][page] = None
        self._num_cached += 1

    def _uncache(self, page: int) -> bool:
        """Take a page out of its tier's LRU; False if it was not cached."""
        if self._cached[self.tier[page]].pop(page, _ABSENT) is _ABSENT:
            return False
        self._num_cached -= 1
        return True

    def _to_free(self, page: int) -> None:
        self.kind[page] = PageKind.FREE
        self.group[page] = -1
        self._free.append(page)

    def check_invariants(self) -> None:
        free = set(self._free)
        if len(free) != len(self._free):
            raise AssertionError("page listed twice in the free list")
        cached = [page for lru in self._cached for page in lru]
        if len(cached) != self._num_cached or len(set(cached)) != len(cached):
            raise AssertionError("cached-page count disagrees with the tier lists")
        for page in range(self.num_pages):
            in_cache = self.is_cached(page)
            states = (page in free) + in_cache + (self.refcount[page] > 0)
            if states != 1:
                raise AssertionError(f"page {page}: free/cached/in-use states overlap or none ({states})")
            if in_cache != (self.refcount[page] == 0 and self.owner[page] is not None):
                raise AssertionError(f"page {page}: cached iff idle and owned")
            if (page in free) != (self.kind[page] == PageKind.FREE):
                raise AssertionError(f"page {page}: kind tag disagrees with the free list")
