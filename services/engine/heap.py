"""The engine process's garbage collector, set up so that the step loop does not stall in it.

A full (generation-2) collection walks every tracked object. Once a worker has built its model, its
libraries and its warm-up, that is hundreds of thousands of objects that live for the whole process
(~360k for the `mini` engine on the meta device: one full pass took 170-180 ms on this 2-core CPU, and
`bench.serve`'s 10-step window at batch 256 on the H200 once took 27 ms/step, a ~0.2 s stall). After
the warm-up everything alive is frozen (`gc.freeze`: a generation the collector never walks), so a later
pass walks only what serving allocated since.

Generation 0 is collected after 20,000 net container allocations instead of CPython's 700: a decode step
at batch 256 allocates ~1,000 short-lived containers (outputs, token lists, tuples), which set off about
two young collections per step (~0.2 ms of the engine thread, measured with `gc.callbacks` in
`bench.serve_host`), though reference counting frees nearly all of them before the next step. Only
cyclic garbage waits longer (at most 20,000 objects).

A frozen object is never collected, so an engine that stops gives its hold back (`release_startup_heap`):
when no holder is left the heap is unfrozen. Otherwise a stopped engine, held by reference cycles (its
thread, its overlap), would stay in memory with its model and page pool for the rest of the process
(several engines started and stopped in one process: the in-process tests).
"""

from __future__ import annotations

import gc
import threading

YOUNG_THRESHOLD = 20_000

_lock = threading.Lock()
_holders = 0  # freezes not yet released: the heap is unfrozen when the last one is


def freeze_startup_heap() -> int:
    """Collect, freeze what is left, and raise generation 0's threshold (never lowers a higher one).
    Returns the number of objects frozen. Process-wide, so call it once the process is built; each call is
    one hold, given back by `release_startup_heap`."""
    global _holders
    with _lock:
        _holders += 1
        gc.collect()
        gc.freeze()
        young, middle, old = gc.get_threshold()
        gc.set_threshold(max(young, YOUNG_THRESHOLD), middle, old)
    return gc.get_freeze_count()  # after the `with`: its exit method, frozen too, is gone by then


def release_startup_heap() -> None:
    """Give back one `freeze_startup_heap` hold; the last one unfreezes the heap (the frozen objects go back
    to the oldest generation), so what the holder left behind can be collected."""
    global _holders
    with _lock:
        if _holders == 0:
            raise RuntimeError("release_startup_heap without a freeze_startup_heap")
        _holders -= 1
        if _holders == 0:
            gc.unfreeze()
