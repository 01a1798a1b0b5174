"""`heap.freeze_startup_heap`: what the engine freezes at start is out of every later collection's walk,
what is allocated after is still collected, and generation 0's threshold only rises. `release_startup_heap`:
once the last hold is given back, what was frozen is collected again, so an engine that stopped (held by
cycles: its thread, its overlap) does not stay in memory with its model and pool."""

from __future__ import annotations

import gc
import weakref

import pytest

from services.engine.heap import YOUNG_THRESHOLD, freeze_startup_heap, release_startup_heap
from tests.workers.cluster import OVERRIDES
from tests.workers.oracle import build_reference
from tests.workers.overlap_harness import ScriptedEngine


class _Node:
    def __init__(self) -> None:
        self.peer: _Node | None = None


def _cycle() -> _Node:
    a, b = _Node(), _Node()
    a.peer, b.peer = b, a
    return a


def test_freezing_keeps_the_startup_heap_out_of_collections_and_collects_new_garbage():
    thresholds, holds = gc.get_threshold(), 0
    try:
        gc.set_threshold(1000, *thresholds[1:])
        before = _cycle()
        frozen = freeze_startup_heap()
        holds += 1
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
        holds += 1
        assert gc.get_threshold()[0] == 10 * YOUNG_THRESHOLD  # a higher setting is left alone
    finally:
        for _ in range(holds):
            release_startup_heap()
        gc.set_threshold(*thresholds)


def test_the_last_release_unfreezes_so_what_was_frozen_is_collected_again():
    thresholds = gc.get_threshold()
    try:
        kept = _cycle()
        startup = weakref.ref(kept)
        freeze_startup_heap()
        freeze_startup_heap()  # two holders (two engines in one process)
        del kept  # the frozen cycle becomes garbage: only the collector can free it
        release_startup_heap()
        gc.collect()
        assert startup() is not None and gc.get_freeze_count() > 0  # another holder: still frozen
        release_startup_heap()
        assert gc.get_freeze_count() == 0
        gc.collect()
        assert startup() is None
        with pytest.raises(RuntimeError):
            release_startup_heap()  # no hold left to give back
    finally:
        gc.set_threshold(*thresholds)


def test_a_stopped_engine_is_collected():
    engine = ScriptedEngine(build_reference("nano", OVERRIDES), True).engine
    engine.start()  # freezes the process's heap, this engine included
    engine.stop()
    engine.stop()  # a second stop gives nothing back twice
    gone = weakref.ref(engine)
    del engine
    gc.collect()
    assert gone() is None and gc.get_freeze_count() == 0
