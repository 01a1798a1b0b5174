"""Staging store of the transfer service: handles, their producer parts, verification and capacity.

A handle is complete when every producer rank (tp_size of them) delivered every page of its part and each
page's bytes matched its fingerprint. Rank 0's part is the whole page list; the other ranks' parts hold only
the head-major pages (the replicated MLA pages travel once), so nothing waits for pages no rank sends. Pages are verified one by one as their last byte lands; a mismatch wipes
only that page (pages verified before it stay), so a retried push resumes at the first unverified page
and earlier state is never overwritten. Capacity is reserved per part when its push starts: a full store
answers RESOURCE_EXHAUSTED with a retry hint (backpressure) instead of buffering without bound.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

import grpc

from k3.v1 import common_pb2, kvtransfer_pb2
from services.kvtransfer import relayout
from services.kvtransfer.chunks import FingerprintMismatch, PageAssembler
from services.runtime import errors


class DataLoss(errors.ServiceError):
    """Bytes arrived but did not match their fingerprint; the sender should resend them."""

    code = grpc.StatusCode.DATA_LOSS
    retriable = True


@dataclass
class PartState:
    handle: common_pb2.KVHandle
    pages: PageAssembler

    @property
    def num_bytes(self) -> int:
        return sum(ref.num_bytes for ref in self.handle.pages)

    @property
    def complete(self) -> bool:
        return self.pages.complete


@dataclass
class HandleEntry:
    handle_id: str
    tp_size: int
    total_heads: int
    created: float
    parts: dict[int, PartState] = field(default_factory=dict)
    ready: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def complete(self) -> bool:
        return len(self.parts) == self.tp_size and all(p.complete for p in self.parts.values())

    @property
    def num_bytes(self) -> int:
        return sum(p.num_bytes for p in self.parts.values())

    def producer_parts(self) -> list[relayout.ProducerPart]:
        return [relayout.ProducerPart(p.handle.layout, list(p.handle.pages), p.pages.pages)
                for _, p in sorted(self.parts.items())]


class HandleStore:
    def __init__(self, capacity_bytes: int, handle_ttl_s: float, retry_after_ms: int = 200):
        self.capacity_bytes = capacity_bytes
        self.handle_ttl_s = handle_ttl_s
        self.retry_after_ms = retry_after_ms
        self.handles: dict[str, HandleEntry] = {}
        self.fingerprint_errors = 0
        self.resumed_pushes = 0

    @property
    def bytes_held(self) -> int:
        return sum(h.num_bytes for h in self.handles.values())

    def begin_part(self, handle: common_pb2.KVHandle) -> tuple[PartState, bool]:
        """Register (or resume: second value True) one producer rank's part of a handle."""
        _validate_handle(handle)
        layout = handle.layout
        entry = self.handles.get(handle.handle_id)
        if entry is not None:
            if (entry.tp_size, entry.total_heads) != (layout.tp_size, layout.total_heads):
                raise errors.InvalidArgument(
                    "chunk.handle.layout", f"tp_size/total_heads {layout.tp_size}/{layout.total_heads} differ "
                    f"from the handle's {entry.tp_size}/{entry.total_heads}")
            existing = entry.parts.get(layout.tp_rank)
            if existing is not None:
                if [r.SerializeToString() for r in existing.handle.pages] != \
                        [r.SerializeToString() for r in handle.pages]:
                    raise errors.InvalidArgument("chunk.handle.pages", "a resumed push must send the same pages")
                self.resumed_pushes += 1
                return existing, True
        needed = sum(ref.num_bytes for ref in handle.pages)
        if self.bytes_held + needed > self.capacity_bytes:
            raise errors.ResourceExhausted(
                f"transfer store full: {self.bytes_held} of {self.capacity_bytes} bytes held, {needed} needed",
                retry_after_ms=self.retry_after_ms)
        if entry is None:
            entry = HandleEntry(handle.handle_id, layout.tp_size, layout.total_heads, time.monotonic())
            self.handles[handle.handle_id] = entry
        part = PartState(handle=handle, pages=PageAssembler(handle))
        entry.parts[layout.tp_rank] = part
        if len(entry.parts) == entry.tp_size:
            problem = relayout.check_parts_tile(entry.producer_parts())
            if problem:
                del entry.parts[layout.tp_rank]
                raise errors.InvalidArgument("chunk.handle.layout", problem)
        return part, False

    def write(self, handle_id: str, part: PartState, chunk: kvtransfer_pb2.PageChunk) -> None:
        """Place one chunk's bytes; a page whose bytes do not match its fingerprint is wiped (DATA_LOSS)."""
        try:
            part.pages.add(chunk)
        except FingerprintMismatch as exc:
            self.fingerprint_errors += 1
            raise DataLoss(f"handle {handle_id} rank {part.handle.layout.tp_rank}: {exc}; resend from this page"
                           ) from exc
        except ValueError as exc:
            raise errors.InvalidArgument("chunk", str(exc)) from exc
        entry = self.handles[handle_id]
        if entry.complete:
            entry.ready.set()

    def get(self, handle_id: str) -> HandleEntry:
        entry = self.handles.get(handle_id)
        if entry is None:
            raise errors.NotFound(f"handle {handle_id!r} is not held (never pushed, released or expired)")
        return entry

    def release(self, handle_id: str) -> bool:
        return self.handles.pop(handle_id, None) is not None

    def sweep(self, now: float | None = None) -> int:
        """Drop handles older than the TTL (a consumer that never pulled must not leak memory)."""
        now = time.monotonic() if now is None else now
        stale = [h for h, e in self.handles.items() if now - e.created > self.handle_ttl_s]
        for handle_id in stale:
            del self.handles[handle_id]
        return len(stale)


def _validate_handle(handle: common_pb2.KVHandle) -> None:
    if not handle.handle_id:
        raise errors.InvalidArgument("chunk.handle.handle_id", "must be set on the first chunk of a stream")
    problem = relayout.layout_problem(handle.layout)
    if problem:
        raise errors.InvalidArgument("chunk.handle.layout", problem)
    for i, ref in enumerate(handle.pages):
        if relayout.is_head_major(ref) and ref.num_bytes % handle.layout.head_count:
            raise errors.InvalidArgument(f"chunk.handle.pages[{i}].num_bytes",
                                         f"{ref.num_bytes} does not split into {handle.layout.head_count} heads")
