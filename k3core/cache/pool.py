"""The page allocator: one free list, one refcount per page, one eviction path for every cache group.

Pages are in one of three states:
- in use: refcount > 0 (a running request's block/state, or pinned by a lookup hit or a pending copy);
- cached: refcount 0 but owned by a cache entry (a registered MLA block or a KDA checkpoint), kept in an
  LRU so that it can be reused by a later hit or reclaimed when memory runs out;
- free: refcount 0 and owned by nothing.

Allocation takes free pages first, then evicts cached pages in LRU order. Evicting a page calls its
owner's `evict` once; the owner unregisters itself everywhere (that is how one group's checkpoint page
takes its sibling groups' pages with it) and hands all of its pages back with `release`.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from enum import IntEnum
from typing import Protocol


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
    def __init__(self, num_pages: int) -> None:
        if num_pages <= 0:
            raise ValueError("num_pages must be positive")
        self.num_pages = num_pages
        self.refcount = [0] * num_pages
        self.kind = [PageKind.FREE] * num_pages
        self.group = [-1] * num_pages
        self.owner: list[PageOwner | None] = [None] * num_pages
        self._free: deque[int] = deque(range(num_pages))
        self._cached: OrderedDict[int, None] = OrderedDict()  # LRU: first = least recently used
        self.evictions = 0

    # ---- capacity -------------------------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_cached(self) -> int:
        return len(self._cached)

    @property
    def num_available(self) -> int:
        return len(self._free) + len(self._cached)

    # ---- allocation -----------------------------------------------------------------------------------
    def allocate(self, kind: PageKind, group: int, count: int = 1) -> list[int]:
        """`count` pages with refcount 1, evicting cached entries (LRU first) when the free list is short."""
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
        """Evict the least recently used cached entry; returns how many pages it freed."""
        if not self._cached:
            raise OutOfPages("nothing left to evict")
        page = next(iter(self._cached))
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
            self._cached.pop(page, None)
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
                self._cached[page] = None

    def touch(self, page: int) -> None:
        """Mark a cached page most recently used."""
        if page in self._cached:
            self._cached.move_to_end(page)

    # ---- ownership by cache entries -------------------------------------------------------------------
    def adopt(self, page: int, owner: PageOwner) -> None:
        """Make `page` part of a cache entry: at refcount 0 it stays cached instead of being freed."""
        if self.owner[page] is not None:
            raise RuntimeError(f"page {page} already has an owner")
        self.owner[page] = owner
        if self.refcount[page] == 0:
            self._cached[page] = None

    def release(self, page: int) -> None:
        """Drop the owner of `page`; it becomes free once no request references it."""
        self.owner[page] = None
        if self.refcount[page] == 0:
            self._cached.pop(page, None)
            self._to_free(page)

    def _to_free(self, page: int) -> None:
        self.kind[page] = PageKind.FREE
        self.group[page] = -1
        self._free.append(page)

    def check_invariants(self) -> None:
        free = set(self._free)
        if len(free) != len(self._free):
            raise AssertionError("page listed twice in the free list")
        for page in range(self.num_pages):
            states = (page in free) + (page in self._cached) + (self.refcount[page] > 0)
            if states != 1:
                raise AssertionError(f"page {page}: free/cached/in-use states overlap or none ({states})")
            if (page in self._cached) != (self.refcount[page] == 0 and self.owner[page] is not None):
                raise AssertionError(f"page {page}: cached iff idle and owned")
            if (page in free) != (self.kind[page] == PageKind.FREE):
                raise AssertionError(f"page {page}: kind tag disagrees with the free list")
