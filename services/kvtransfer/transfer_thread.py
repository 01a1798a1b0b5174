"""An event loop on its own thread, for callers that compute on theirs (a worker rank's step loop).

Transfers submitted here make progress (socket reads, chunk reassembly, fingerprints) while the calling
thread runs the model forward, which releases the GIL in its kernels; the caller waits only where it
needs a result. gRPC aio channels belong to the loop they were made on, so transports are made here too.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


class TransferThread:
    def __init__(self, name: str = "k3-transfer"):
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name=name, daemon=True)
        self._thread.start()

    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        """Start `coro` on the transfer loop now; the future holds its result or exception."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        """Run `coro` on the transfer loop and wait for it."""
        return self.submit(coro).result()

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join()
        self.loop.close()
