"""Pages as streams of per-head byte ranges (PageChunk messages), and their reassembly."""

from __future__ import annotations

from collections.abc import Iterator, Sequence

from k3.v1 import common_pb2, kvtransfer_pb2
from services.kvtransfer import relayout

DEFAULT_MAX_CHUNK_BYTES = 1 << 20


def page_chunks(handle: common_pb2.KVHandle, pages: Sequence[bytes | bytearray], start: int = 0,
                max_chunk_bytes: int = DEFAULT_MAX_CHUNK_BYTES) -> Iterator[kvtransfer_pb2.PageChunk]:
    """The handle (first chunk), then each page from `start` as its head ranges, cut to `max_chunk_bytes`."""
    first = True
    for index in range(start, len(handle.pages)):
        ref, data = handle.pages[index], memoryview(pages[index])
        ranges = relayout.head_ranges(ref, handle.layout)
        for r_index, head_range in enumerate(ranges):
            offsets = range(head_range.offset, head_range.offset + head_range.length, max_chunk_bytes) or [0]
            for offset in offsets:
                end = min(offset + max_chunk_bytes, head_range.offset + head_range.length)
                chunk = kvtransfer_pb2.PageChunk(page_index=index, head=head_range.head, offset=offset,
                                                 data=bytes(data[offset:end]))
                chunk.last = r_index == len(ranges) - 1 and end == head_range.offset + head_range.length
                if first:
                    chunk.handle.CopyFrom(handle)
                    first = False
                yield chunk
    if first:  # nothing left to send: the handle alone still opens (or resumes) the stream
        yield kvtransfer_pb2.PageChunk(handle=handle, page_index=len(handle.pages), last=True)


class FingerprintMismatch(ValueError):
    pass


class PageAssembler:
    """Collects chunks of a stream into page buffers and verifies each page as it completes."""

    def __init__(self, handle: common_pb2.KVHandle):
        self.handle = handle
        self.pages: list[bytearray] = [bytearray(ref.num_bytes) for ref in handle.pages]
        self.received = [0] * len(handle.pages)
        self.verified = [False] * len(handle.pages)

    def add(self, chunk: kvtransfer_pb2.PageChunk) -> int | None:
        """Place a chunk; returns the page index when that page completed and verified. Raises
        FingerprintMismatch when it did not match (its bytes are discarded), ValueError on a bad position.
        Chunks of pages that already verified (resent by a resumed stream) are ignored."""
        index = chunk.page_index
        if index >= len(self.pages):
            if index == len(self.pages) and not chunk.data:
                return None  # the empty opener of a stream with nothing left to send
            raise ValueError(f"page_index {index} >= {len(self.pages)} pages")
        if self.verified[index]:
            return None
        buffer = self.pages[index]
        end = chunk.offset + len(chunk.data)
        if end > len(buffer):
            raise ValueError(f"bytes [{chunk.offset}, {end}) exceed page {index} of {len(buffer)} bytes")
        buffer[chunk.offset:end] = chunk.data
        self.received[index] += len(chunk.data)
        if self.received[index] < len(buffer):
            return None
        if self.received[index] > len(buffer) or \
                relayout.page_fingerprint(buffer) != self.handle.pages[index].fingerprint:
            self.received[index] = 0
            raise FingerprintMismatch(f"page {index} failed its fingerprint check")
        self.verified[index] = True
        return index

    @property
    def complete(self) -> bool:
        return all(self.verified)

    @property
    def verified_prefix(self) -> int:
        count = 0
        while count < len(self.verified) and self.verified[count]:
            count += 1
        return count
