"""The server's side of a request stream for the serving benchmarks: `RequestStream`s on an event-loop thread,
each drained by a task as the gRPC servicer drains it (without gRPC)."""

from __future__ import annotations

import asyncio
import time

from services.engine.engine import Engine
from services.engine.params import GenerationOptions
from services.engine.request import EngineRequest, Phase
from services.engine.streams import RequestStream
from services.kvtransfer.transfer_thread import TransferThread

# The benchmarks' rows: greedy, never stopping on their own.
GREEDY = GenerationOptions(temperature=0.0, top_k=0, top_p=1.0, seed=0, max_tokens=1 << 20, stop=(),
                           stop_token_ids=frozenset(), ignore_eos=True)


class StreamLoop:
    """The server's event loop on its own thread: the requests' `RequestStream`s, each drained through its
    `outputs` iterator as the gRPC servicer does (undrained queues would grow, and the garbage collector's
    passes over them with it)."""

    def __init__(self) -> None:
        self.thread = TransferThread("bench-streams")
        self._run = self.thread.run
        self.tasks: list[asyncio.Task] = []

    def stream(self) -> RequestStream:
        async def make() -> RequestStream:
            return RequestStream()
        return self._run(make())

    def drain(self, stream: RequestStream, engine: Engine, req: EngineRequest) -> None:
        async def consume() -> None:
            async for _ in stream.outputs(engine, req):
                pass

        async def spawn() -> None:
            self.tasks.append(asyncio.get_running_loop().create_task(consume()))
        self._run(spawn())

    def running(self, engine: Engine, rid: str, prompt: list[int], output: list[int]) -> EngineRequest:
        """A greedy request already in the engine's running batch (its prompt computed, `output` its pending
        token), streaming into a drained `RequestStream`; the caller makes the cache manager's calls."""
        stream = self.stream()
        req = EngineRequest(rid, prompt, GREEDY, emit=stream.emit, phase=Phase.RUNNING, output=output)
        self.drain(stream, engine, req)
        req.first_token_at = req.last_token_at = time.monotonic()
        engine.requests[rid] = req
        engine.scheduler.running.append(req)
        return req

    def close(self) -> None:
        async def finish() -> None:
            for task in self.tasks:
                task.cancel()
            await asyncio.gather(*self.tasks, return_exceptions=True)
        self._run(finish())
        self.thread.close()
