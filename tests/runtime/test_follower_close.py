"""Closing an etcd follower right after it synced must not wait out its thread's join timeout."""

from __future__ import annotations

import time

from services.runtime.registry import Watcher


def test_close_right_after_sync_stops_the_watch_thread(etcd_server):
    # Between marking itself synced and starting its watch the thread has nothing close() can cancel; the
    # old code then sat in the watch until close() gave up joining (2 s) and leaked the thread.
    for _ in range(5):
        watcher = Watcher([etcd_server], "/k3test-close")
        assert watcher.wait_synced(10)
        started = time.monotonic()
        watcher.close()
        assert not watcher._thread.is_alive(), "the watch thread outlived close()"
        assert time.monotonic() - started < 1.5
