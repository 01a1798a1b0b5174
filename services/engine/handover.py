"""Outputs handed from the engine thread to the event loops that serve their streams.

A wake-up of an event loop from another thread (`call_soon_threadsafe`) is a write to its self-pipe: 6-12 us
of the engine thread each. So outputs go through one `Mailbox` per loop, and the loop is woken once per
burst: inside `burst()` (the engine's hand-over of a step's outputs) posts only queue, and its end wakes
each loop posted to; outside a burst the first post wakes the loop and later ones ride along while that
delivery is due or running. A loop that has closed (its server shut down) has nobody left to read its
streams: its mailbox drops what it holds and everything posted later, and the other loops are still woken.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Protocol

log = logging.getLogger(__name__)
_current = threading.local()  # .boxes: the mailboxes posted to in this thread's open burst, else None


class Receiver(Protocol):
    """Where a delivery puts an item, on the loop's thread (a stream's `OutputQueue`)."""

    def put_nowait(self, item: Any) -> None: ...


class Mailbox:
    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.items: deque[tuple[Receiver, Any]] = deque()
        self.scheduled = False
        self.closed = False  # the loop was found closed: posts are dropped

    def post(self, queue: Receiver, item: Any) -> None:
        if self.closed:
            return
        self.items.append((queue, item))
        boxes = getattr(_current, "boxes", None)
        if boxes is None:
            self.wake()
        else:
            boxes.add(self)

    def wake(self) -> None:
        if not self.scheduled:  # else a delivery due or running takes the items (it checks after its reset)
            self.scheduled = True
            try:
                self.loop.call_soon_threadsafe(self._deliver)
            except RuntimeError as exc:
                if not self.loop.is_closed():
                    raise
                self._close(exc)

    def _close(self, reason: Exception) -> None:
        """The loop is closed: the engine thread must go on serving the other loops' streams."""
        self.closed = True
        log.warning("dropping %d output(s) and all later ones for streams of a closed event loop: %s",
                    len(self.items), reason)
        self.items.clear()

    def _deliver(self) -> None:
        while True:
            while self.items:
                queue, item = self.items.popleft()
                queue.put_nowait(item)
            self.scheduled = False  # posts from here on wake the loop again ...
            if not self.items:
                return
            self.scheduled = True  # ... unless one slipped in before the reset: take it now


@contextmanager
def burst() -> Iterator[None]:
    """Posts from this thread inside the block wake their loops once, at its end."""
    _current.boxes = boxes = set()
    try:
        yield
    finally:
        _current.boxes = None
        for box in boxes:
            box.wake()
