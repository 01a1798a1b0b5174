"""`heap.freeze_startup_heap`: what the engine freezes at start is out of every later collection's walk,
what is allocated after is still collected, and generation 0's threshold only rises."""

from __future__ import annotations

import gc
import weakref

from services.engine.heap import YOUNG_THRESHOLD, freeze_startup_heap


class _Node:
    def __init__(self) -> None:
        self.peer: _Node | None = None


def _cycle() -> _Node:
    a, b = _Node(), _Node()
    a.peer, b.peer = b, a
    return a


def test_freezing_keeps_the_startup_heap_out_of_collections_and_collects_new_garbage():
    thresholds = gc.get_threshold()
    try:
        gc.set_threshold(1000, *thresholds[1:])
        before = _cycle()
        frozen = freeze_startup_heap()
        assert frozen >= 2 and gc.get_freeze_count() == frozen
        tracked = {id(o) for o in gc.get_objects()}  # the generations a collection walks
        assert id(before) not in tracked and id(before.peer) not in tracked
        garbage = weakref.ref(_cycle())  # a cycle made after the freeze: only the collector frees it
        assert garbage() is not None
        gc.collect()
        assert garbage() is None
        assert gc.get_threshold() == (YOUNG_THRESHOLD, *thresholds[1:])
        gc.set_threshold(10 * YOUNG_THRESHOLD, *thresholds[1:])
        freeze_startup_heap()
        assert gc.get_threshold()[0] == 10 * YOUNG_THRESHOLD  # a higher setting is left alone
    finally:
        gc.unfreeze()
        gc.set_threshold(*thresholds)
