"""The KVTransferService servicer: push (verify on arrival), pull (re-laid per consumer rank), release."""

from __future__ import annotations

import asyncio
import time

from k3.v1 import common_pb2, kvtransfer_pb2, kvtransfer_pb2_grpc
from services.kvtransfer import metrics, relayout
from services.kvtransfer.chunks import page_chunks
from services.kvtransfer.store import DataLoss, HandleStore
from services.runtime import errors


class KVTransferServicer(kvtransfer_pb2_grpc.KVTransferServiceServicer):
    def __init__(self, store: HandleStore, pull_wait_s: float, max_chunk_bytes: int):
        self.store = store
        self.pull_wait_s = pull_wait_s
        self.max_chunk_bytes = max_chunk_bytes
        self.bytes_in = 0
        self.bytes_out = 0
        self.busy_s = 0.0

    async def Push(self, request_iterator, context) -> kvtransfer_pb2.PushResponse:
        started = time.perf_counter()
        part, handle_id, received = None, "", 0
        try:
            async for request in request_iterator:
                chunk = request.chunk
                if part is None:
                    if not chunk.HasField("handle"):
                        raise errors.InvalidArgument("chunk.handle", "the first chunk of a push must carry it")
                    try:
                        part, resumed = self.store.begin_part(chunk.handle)
                    except errors.ResourceExhausted:
                        metrics.REJECTED_FULL.inc()
                        raise
                    handle_id = chunk.handle.handle_id
                    if resumed:
                        metrics.RESUMED_PUSHES.inc()
                received += len(chunk.data)
                try:
                    self.store.write(handle_id, part, chunk)
                except DataLoss:
                    metrics.FINGERPRINT_ERRORS.inc()
                    raise
        finally:
            self._account(received, 0, started)
        if part is None:
            raise errors.InvalidArgument("chunk", "empty push stream")
        return kvtransfer_pb2.PushResponse(handle_id=handle_id, bytes_received=received,
                                           pages_verified=sum(part.pages.verified))

    async def Pull(self, request, context):
        if not request.handle_id:
            raise errors.InvalidArgument("handle_id", "must be set")
        layout = request.consumer_layout
        problem = relayout.layout_problem(layout)
        if problem:
            raise errors.InvalidArgument("consumer_layout", problem)
        entry = self.store.get(request.handle_id)
        if layout.total_heads != entry.total_heads:
            raise errors.InvalidArgument("consumer_layout.total_heads",
                                         f"{layout.total_heads} != the handle's {entry.total_heads}")
        try:
            await asyncio.wait_for(entry.ready.wait(), self.pull_wait_s)
        except TimeoutError:
            raise errors.Unavailable(f"handle {request.handle_id} incomplete after {self.pull_wait_s}s "
                                     "(a producer rank has not finished its push)", retry_after_ms=500) from None
        parts = entry.producer_parts()
        first = parts[0].refs
        if request.from_page > len(first):
            raise errors.InvalidArgument("from_page", f"{request.from_page} > {len(first)} pages")
        pages = [relayout.relayout_page(parts, i, layout) for i in range(len(first))]
        source = entry.parts[min(entry.parts)].handle
        handle = common_pb2.KVHandle(handle_id=source.handle_id, request_id=source.request_id,
                                     producer=source.producer, layout=layout, num_tokens=source.num_tokens,
                                     model=source.model,
                                     pages=[relayout.consumer_ref(parts, i, layout, p) for i, p in enumerate(pages)])
        started = time.perf_counter()
        sent = 0
        try:
            for chunk in page_chunks(handle, pages, request.from_page, self.max_chunk_bytes):
                sent += len(chunk.data)
                yield kvtransfer_pb2.PullResponse(chunk=chunk)
        finally:
            self._account(0, sent, started)

    async def Release(self, request, context) -> kvtransfer_pb2.ReleaseResponse:
        found = self.store.release(request.handle_id)
        self._gauges()
        return kvtransfer_pb2.ReleaseResponse(found=found)

    async def GetHandleStatus(self, request, context) -> kvtransfer_pb2.GetHandleStatusResponse:
        entry = self.store.handles.get(request.handle_id)
        if entry is None:
            return kvtransfer_pb2.GetHandleStatusResponse(found=False)
        producers = [kvtransfer_pb2.ProducerProgress(tp_rank=rank, pages_verified=part.pages.verified_prefix,
                                                     pages_total=len(part.handle.pages))
                     for rank, part in sorted(entry.parts.items())]
        return kvtransfer_pb2.GetHandleStatusResponse(found=True, complete=entry.complete, producers=producers,
                                                      num_bytes=entry.num_bytes)

    async def GetTransferStats(self, request, context) -> kvtransfer_pb2.GetTransferStatsResponse:
        return kvtransfer_pb2.GetTransferStatsResponse(
            bytes_in=self.bytes_in, bytes_out=self.bytes_out, bytes_per_second=self.bytes_per_second,
            handles_held=len(self.store.handles), fingerprint_errors=self.store.fingerprint_errors,
            retries=self.store.resumed_pushes)

    @property
    def bytes_per_second(self) -> float:
        return (self.bytes_in + self.bytes_out) / self.busy_s if self.busy_s else 0.0

    def _account(self, bytes_in: int, bytes_out: int, started: float) -> None:
        self.bytes_in += bytes_in
        self.bytes_out += bytes_out
        self.busy_s += time.perf_counter() - started
        metrics.BYTES_IN.inc(bytes_in)
        metrics.BYTES_OUT.inc(bytes_out)
        metrics.THROUGHPUT.set(self.bytes_per_second)
        self._gauges()

    def _gauges(self) -> None:
        metrics.HANDLES_HELD.set(len(self.store.handles))
        metrics.BYTES_HELD.set(self.store.bytes_held)
