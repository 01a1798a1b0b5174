"""`Transport` over the transfer service's gRPC streams, with resumable retries.

A broken push asks the service which pages of this rank already verified and resends from the first that
did not; a fingerprint mismatch (DATA_LOSS) is retried the same way. A broken or corrupted pull resumes at
the first page the consumer has not verified. RESOURCE_EXHAUSTED (a full store) is retried after the
service's hint: that is the backpressure reaching the producer.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence

import grpc

from k3.v1 import common_pb2, kvtransfer_pb2, kvtransfer_pb2_grpc
from services.kvtransfer.chunks import (
    DEFAULT_MAX_CHUNK_BYTES,
    FingerprintMismatch,
    PageAssembler,
    page_chunks,
)
from services.kvtransfer.transport import PulledCache, TransferError
from services.runtime.client import aio_channel
from services.runtime.errors import error_detail

log = logging.getLogger("k3.kvtransfer.client")

RETRIABLE = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DATA_LOSS, grpc.StatusCode.RESOURCE_EXHAUSTED,
             grpc.StatusCode.ABORTED, grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN}


class GrpcTransport:
    def __init__(self, address: str, token: str = "", *, attempts: int = 8, backoff_s: float = 0.05,
                 max_chunk_bytes: int = DEFAULT_MAX_CHUNK_BYTES, timeout_s: float = 120.0):
        self.address = address
        self.attempts = attempts
        self.backoff_s = backoff_s
        self.max_chunk_bytes = max_chunk_bytes
        self.timeout_s = timeout_s
        self.retries = 0
        self._channel = aio_channel(address, token)
        self._stub = kvtransfer_pb2_grpc.KVTransferServiceStub(self._channel)

    async def push(self, handle: common_pb2.KVHandle, pages: Sequence[bytes | bytearray]) -> None:
        if len(pages) != len(handle.pages):
            raise ValueError(f"{len(pages)} page buffers for {len(handle.pages)} page refs")
        start = 0
        for attempt in range(self.attempts):
            if attempt:
                start = await self._verified_prefix(handle.handle_id, handle.layout.tp_rank)
            requests = (kvtransfer_pb2.PushRequest(chunk=c)
                        for c in page_chunks(handle, pages, start, self.max_chunk_bytes))
            try:
                await self._stub.Push(requests, timeout=self.timeout_s)
                return
            except grpc.aio.AioRpcError as err:
                await self._backoff_or_raise(err, attempt, f"push {handle.handle_id}")

    async def pull(self, handle_id: str, layout: common_pb2.TensorParallelLayout) -> PulledCache:
        assembler: PageAssembler | None = None
        for attempt in range(self.attempts):
            start = assembler.verified_prefix if assembler else 0
            request = kvtransfer_pb2.PullRequest(handle_id=handle_id, consumer_layout=layout, from_page=start)
            try:
                async for response in self._stub.Pull(request, timeout=self.timeout_s):
                    chunk = response.chunk
                    if assembler is None:
                        assembler = PageAssembler(chunk.handle)
                    assembler.add(chunk)
                if assembler is not None and assembler.complete:
                    return PulledCache(assembler.handle, [bytes(p) for p in assembler.pages])
                raise TransferError(f"pull {handle_id}: stream ended before every page arrived", True)
            except grpc.aio.AioRpcError as err:
                await self._backoff_or_raise(err, attempt, f"pull {handle_id}")
            except FingerprintMismatch as exc:
                log.warning("pulled page corrupted; resuming", extra={"handle": handle_id, "error": str(exc)})
                await self._sleep(attempt)
        raise TransferError(f"pull {handle_id}: gave up after {self.attempts} attempts", True)

    async def release(self, handle_id: str) -> bool:
        response = await self._stub.Release(kvtransfer_pb2.ReleaseRequest(handle_id=handle_id), timeout=10)
        return response.found

    async def status(self, handle_id: str) -> kvtransfer_pb2.GetHandleStatusResponse:
        return await self._stub.GetHandleStatus(kvtransfer_pb2.GetHandleStatusRequest(handle_id=handle_id),
                                                timeout=10)

    async def stats(self) -> kvtransfer_pb2.GetTransferStatsResponse:
        return await self._stub.GetTransferStats(kvtransfer_pb2.GetTransferStatsRequest(), timeout=10)

    async def close(self) -> None:
        await self._channel.close()

    async def _verified_prefix(self, handle_id: str, rank: int) -> int:
        try:
            status = await self.status(handle_id)
        except grpc.aio.AioRpcError:
            return 0  # the service is unreachable: the next push attempt reports why
        for producer in status.producers:
            if producer.tp_rank == rank:
                return producer.pages_verified
        return 0

    async def _backoff_or_raise(self, err: grpc.aio.AioRpcError, attempt: int, what: str) -> None:
        code = err.code()
        if code not in RETRIABLE or attempt == self.attempts - 1:
            raise TransferError(f"{what}: {code.name}: {err.details()}", code in RETRIABLE) from err
        detail = error_detail(err)
        log.warning("transfer stream failed; retrying", extra={"what": what, "code": code.name,
                                                               "details": err.details(), "attempt": attempt})
        await self._sleep(attempt, (detail.retry_after_ms / 1000) if detail and detail.retry_after_ms else 0)

    async def _sleep(self, attempt: int, hint_s: float = 0.0) -> None:
        self.retries += 1
        await asyncio.sleep(max(hint_s, self.backoff_s * (2 ** attempt)))
