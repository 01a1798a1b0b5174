"""The allocator: one free list, refcounts, one LRU eviction path that takes whole entries."""

from __future__ import annotations

import pytest

from k3core.cache.pool import OutOfPages, PageKind, PagePool


class Entry:
    def __init__(self, pool: PagePool, pages: list[int]) -> None:
        self.pool, self.pages, self.evicted = pool, pages, 0
        for page in pages:
            pool.adopt(page, self)

    def evict(self) -> None:
        self.evicted += 1
        for page in self.pages:
            self.pool.release(page)


def test_free_pages_first_then_lru_entries_whole() -> None:
    pool = PagePool(6)
    a = Entry(pool, pool.allocate(PageKind.KDA, 0, 2))  # a two-group entry
    b = Entry(pool, pool.allocate(PageKind.MLA, 0, 2))
    for page in a.pages + b.pages:
        pool.decref(page)  # idle: cached, a older than b
    pool.touch(a.pages[0])  # a's first page is now the most recent, its second still the oldest
    assert pool.num_free == 2 and pool.num_cached == 4
    taken = pool.allocate(PageKind.MLA, 0, 4)
    assert a.evicted == 1 and b.evicted == 0  # the oldest page belonged to a: all of a went
    assert set(a.pages) <= set(taken)
    pool.check_invariants()


def test_in_use_pages_are_never_evicted() -> None:
    pool = PagePool(3)
    entry = Entry(pool, pool.allocate(PageKind.MLA, 0, 2))  # refcount 1: a running request holds it
    pool.allocate(PageKind.KDA, 1)
    with pytest.raises(OutOfPages):
        pool.allocate(PageKind.KDA, 1)
    assert entry.evicted == 0
    pool.check_invariants()


def test_refcounts_and_tags() -> None:
    pool = PagePool(2)
    page = pool.allocate(PageKind.KDA, 3)[0]
    assert (pool.kind[page], pool.group[page], pool.refcount[page]) == (PageKind.KDA, 3, 1)
    pool.incref(page)
    pool.decref(page)
    pool.decref(page)
    assert pool.kind[page] == PageKind.FREE and pool.num_free == 2
    with pytest.raises(RuntimeError, match="below zero"):
        pool.decref(page)
    with pytest.raises(RuntimeError, match="free page"):
        pool.incref(page)
