"""What workers call to move cache pages; the wire underneath is replaceable.

Prefill ranks `push` their part of a handle, decode ranks `pull` the pages laid out for their own TP rank
and `release` the handle once their cache holds it. `GrpcTransport` streams over TCP through the transfer
service; an RDMA/NVLink engine (Mooncake Transfer Engine, NIXL) would implement the same three calls by
registering the pages' memory and letting the consumer read the head ranges directly, with the transfer
service keeping only the handle metadata. Callers never see which one runs.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from k3.v1 import common_pb2


@dataclass(frozen=True)
class PulledCache:
    """A handle's pages as one consumer rank holds them (ref i describes pages[i])."""

    handle: common_pb2.KVHandle
    pages: list[bytes]


class TransferError(RuntimeError):
    """A transfer failed for good (after retries); `retriable` says whether a later attempt may work."""

    def __init__(self, message: str, retriable: bool):
        super().__init__(message)
        self.retriable = retriable


class Transport(Protocol):
    async def push(self, handle: common_pb2.KVHandle, pages: Sequence[bytes | bytearray]) -> None:
        """Deliver one producer rank's part (handle.layout says which heads); retried until verified."""

    async def pull(self, handle_id: str, layout: common_pb2.TensorParallelLayout) -> PulledCache:
        """The handle's pages re-laid for the consumer rank `layout`; waits for every producer rank."""

    async def release(self, handle_id: str) -> bool:
        """Free the staged pages; True when the handle was still held."""

    async def close(self) -> None:
        """Close connections."""
