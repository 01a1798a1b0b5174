"""The engine -> stream hand-over (`RequestStream.emit` through the loop's mailbox, services/engine/handover.py):
every output arrives, in order per stream; posts made while the loop is busy, or inside a `burst()` (the
engine's `_flush`) while it runs freely, wake it once instead of once per output; a loop that has closed
loses its outputs but neither the engine thread nor the other loops' streams."""

from __future__ import annotations

import asyncio
import logging
import threading
import time

from k3.v1 import common_pb2
from services.engine import handover
from services.engine.request import EngineRequest, StepOutput
from services.engine.streams import RequestStream
from tests.workers.cluster import OVERRIDES
from tests.workers.oracle import build_reference
from tests.workers.overlap_harness import ScriptedEngine, options


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


def _stream_of_a_closed_loop() -> RequestStream:
    """A stream whose server loop has shut down (built on its own loop, which is then closed)."""
    loop = asyncio.new_event_loop()

    async def new_stream() -> RequestStream:
        return RequestStream()
    try:
        return loop.run_until_complete(new_stream())
    finally:
        loop.close()


async def test_a_burst_skips_a_closed_loops_mailbox_and_wakes_the_others(caplog):
    gone, live = await asyncio.to_thread(_stream_of_a_closed_loop), RequestStream()
    caplog.set_level(logging.WARNING, logger=handover.__name__)

    def post_bursts() -> None:
        for step in range(3):
            with handover.burst():
                gone.emit(StepOutput([step]))
                live.emit(StepOutput([step]))
        gone.emit(StepOutput([3]))  # outside a burst too: dropped, no error
    await asyncio.to_thread(post_bursts)
    assert [(await live._queue.get()).token_ids[0] for _ in range(3)] == [0, 1, 2]
    assert gone._mailbox.closed and not gone._mailbox.items and gone._queue.empty()
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "closed" in warnings[0].getMessage()


async def test_a_closed_loop_leaves_the_engine_serving_the_other_streams():
    model = build_reference("nano", OVERRIDES)
    engine, vocab = ScriptedEngine(model, True).engine, model.config.vocab_size  # started: its real thread
    gone, live = await asyncio.to_thread(_stream_of_a_closed_loop), RequestStream()
    engine.start()
    try:
        requests = []
        for rid, stream in (("gone", gone), ("live", live), ("gone2", gone)):
            requests.append(EngineRequest(rid, [5, 9, 14, 3 + len(rid)], options(vocab, max_tokens=6, ignore_eos=True),
                                          stream.emit))
            engine.submit(requests[-1])
        outputs = [out async for out in live.outputs(engine, requests[1])]
        assert sum(len(out.token_ids) for out in outputs) == 6
        assert outputs[-1].finish_reason == common_pb2.FINISH_REASON_LENGTH
        assert engine.alive and engine.failure is None
        later = RequestStream()  # and the engine goes on serving new requests
        req = EngineRequest("later", [7, 8], options(vocab, max_tokens=3, ignore_eos=True), later.emit)
        engine.submit(req)
        assert sum(len(out.token_ids) for out in [out async for out in later.outputs(engine, req)]) == 3
    finally:
        await asyncio.to_thread(engine.stop)


async def test_a_reader_cancelled_while_waiting_loses_nothing():
    """`OutputQueue` (the stream's queue): a reader cancelled in `get` leaves its wake-up behind; outputs put
    after that are all read, in order, by the next reader."""
    queue = RequestStream()._queue
    waiting = asyncio.create_task(queue.get())
    await asyncio.sleep(0)
    waiting.cancel()
    await asyncio.gather(waiting, return_exceptions=True)
    assert waiting.cancelled() and queue.empty()
    for token in range(3):
        queue.put_nowait(StepOutput([token]))
    assert not queue.empty()
    assert [(await queue.get()).token_ids[0] for _ in range(3)] == [0, 1, 2]
    reader = asyncio.create_task(queue.get())  # waits, then is woken by the next put
    await asyncio.sleep(0)
    assert not reader.done()
    queue.put_nowait(StepOutput([7]))
    assert (await reader).token_ids == [7] and queue.empty()
