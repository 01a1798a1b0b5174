"""The engine -> stream hand-over (`RequestStream.emit` through the loop's mailbox, services/engine/handover.py):
every output arrives, in order per stream; posts made while the loop is busy, or inside a `burst()` (the
engine's `_flush`) while it runs freely, wake it once instead of once per output."""

from __future__ import annotations

import asyncio
import threading
import time

from services.engine import handover
from services.engine.request import StepOutput
from services.engine.streams import RequestStream


def _post(streams: list[RequestStream], steps: int) -> None:
    for step in range(steps):
        for i, stream in enumerate(streams):
            stream.emit(StepOutput([1000 * step + i]))


async def _drain(streams: list[RequestStream], steps: int) -> list[list[int]]:
    return [[(await s._queue.get()).token_ids[0] for _ in range(steps)] for s in streams]


def _counting_wakeups(loop: asyncio.AbstractEventLoop) -> list[int]:
    wakeups: list[int] = []
    original = loop.call_soon_threadsafe
    loop.call_soon_threadsafe = lambda *args, **kwargs: wakeups.append(1) or original(*args, **kwargs)  # type: ignore[method-assign]
    return wakeups


async def test_posts_while_the_loop_is_busy_wake_it_once_and_keep_each_streams_order():
    loop = asyncio.get_running_loop()
    streams = [RequestStream() for _ in range(20)]
    wakeups = _counting_wakeups(loop)
    try:
        poster = threading.Thread(target=_post, args=(streams, 5))
        poster.start()
        poster.join()  # the loop is blocked here: every post lands before its first delivery
        got = await _drain(streams, 5)
    finally:
        del loop.call_soon_threadsafe
    assert len(wakeups) == 1
    assert got == [[1000 * step + i for step in range(5)] for i in range(20)]


async def test_a_burst_wakes_a_running_loop_once_at_its_end():
    loop = asyncio.get_running_loop()
    streams = [RequestStream() for _ in range(20)]
    wakeups = _counting_wakeups(loop)

    def post_bursts() -> None:
        for step in range(10):
            with handover.burst():
                for i, stream in enumerate(streams):
                    stream.emit(StepOutput([1000 * step + i]))
                    time.sleep(0.001)  # the loop delivers and idles between posts: each would wake it again
    try:
        poster = asyncio.create_task(asyncio.to_thread(post_bursts))
        got = await _drain(streams, 10)
        await poster
    finally:
        del loop.call_soon_threadsafe
    assert len(wakeups) <= 11  # one per burst, and to_thread handing back its result
    assert got == [[1000 * step + i for step in range(10)] for i in range(20)]


async def test_outputs_posted_while_the_loop_delivers_all_arrive_in_order():
    streams = [RequestStream() for _ in range(8)]
    poster = asyncio.create_task(asyncio.to_thread(_post, streams, 400))
    got = await _drain(streams, 400)
    await poster
    assert got == [[1000 * step + i for step in range(400)] for i in range(8)]
    assert all(s._queue.empty() for s in streams)
