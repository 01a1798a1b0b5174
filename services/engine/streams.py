"""The bridge between the engine thread and a gRPC stream on the server's event loop."""

from __future__ import annotations

import asyncio
import weakref
from collections import deque
from collections.abc import AsyncIterator

from k3.v1 import common_pb2
from services.engine.engine import Engine
from services.engine.handover import Mailbox
from services.engine.request import EngineRequest, StepOutput

_mailboxes: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, Mailbox] = weakref.WeakKeyDictionary()


class OutputQueue:
    """A request's outputs in order, for its one reader, on the loop's thread: a deque and the reader's
    wake-up future. (`asyncio.Queue`'s getter bookkeeping cost the loop ~0.75 us an output more here: a
    burst of 256 outputs to 256 readers took 0.57 ms against 0.38.)"""

    __slots__ = ("_items", "_waiter")

    def __init__(self) -> None:
        self._items: deque[StepOutput] = deque()
        self._waiter: asyncio.Future[None] | None = None

    def put_nowait(self, output: StepOutput) -> None:
        self._items.append(output)
        waiter, self._waiter = self._waiter, None
        if waiter is not None and not waiter.done():  # done: its reader was cancelled while waiting
            waiter.set_result(None)

    def empty(self) -> bool:
        return not self._items

    async def get(self) -> StepOutput:
        while not self._items:
            self._waiter = asyncio.get_running_loop().create_future()
            await self._waiter
        return self._items.popleft()


class RequestStream:
    """Queue of a request's outputs; `emit` is called on the engine thread."""

    def __init__(self) -> None:
        loop = asyncio.get_running_loop()
        self._mailbox = _mailboxes.get(loop) or _mailboxes.setdefault(loop, Mailbox(loop))
        self._queue = OutputQueue()

    def emit(self, output: StepOutput) -> None:
        self._mailbox.post(self._queue, output)

    async def outputs(self, engine: Engine, req: EngineRequest) -> AsyncIterator[StepOutput]:
        """Yields outputs until the request ends; raises the engine's error. If the caller goes away
        (cancelled, disconnected), the engine is told at once so the request's pages are freed."""
        done = False
        try:
            while True:
                output = await self._queue.get()
                if output.error is not None:
                    done = True
                    raise output.error
                done = output.finish_reason != common_pb2.FINISH_REASON_UNSPECIFIED
                yield output
                if done:
                    return
        finally:
            if not done:
                engine.cancel(req.rid)


def token_chunk(req: EngineRequest, output: StepOutput) -> common_pb2.TokenChunk:
    chunk = common_pb2.TokenChunk(request_id=req.rid, token_ids=output.token_ids, text=output.text,
                                  finish_reason=output.finish_reason, logprobs=output.logprobs)
    if output.ttft_s is not None:
        chunk.ttft_ms = 1e3 * output.ttft_s
    if output.finish_reason != common_pb2.FINISH_REASON_UNSPECIFIED:
        chunk.usage.CopyFrom(common_pb2.Usage(prompt_tokens=len(req.prompt), cached_tokens=req.cached_tokens,
                                              completion_tokens=len(req.output)))
    return chunk
