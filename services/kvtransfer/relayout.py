"""Tensor-parallel re-layout of cache pages on the transfer path (K3 report §5.4.1).

A KDA page of one TP rank is head-major: the bytes of each of its heads form one contiguous range of equal
size. A consumer rank that owns heads [c0, c0 + n) therefore receives, for each KDA page, the concatenation
of those heads' ranges, taken from whichever producer ranks hold them: the transfer path only slices and
concatenates bytes, and neither side shuffles anything on the GPU. MLA pages hold the latent, which is
shared by all heads and replicated on every rank, so one copy serves every consumer rank: producer rank 0
sends the handle's whole page list, ranks > 0 send only their head-major pages (the same pages, in the
same order, with their own heads' bytes), so (p-1)/p of the replicated bytes never travel.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property

from k3.v1 import common_pb2

HEAD_MAJOR_KINDS = (common_pb2.CACHE_KIND_KDA_STATE, common_pb2.CACHE_KIND_KDA_CONV)


def page_fingerprint(data: bytes | bytearray | memoryview) -> int:
    """64-bit BLAKE2b of raw page bytes (the same function as k3core.cache.hashing.fingerprint)."""
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little")


def rank_layout(total_heads: int, tp_size: int, tp_rank: int) -> common_pb2.TensorParallelLayout:
    """The standard contiguous split: rank r owns heads [r*H/tp, (r+1)*H/tp)."""
    if tp_size <= 0 or total_heads % tp_size:
        raise ValueError(f"tp_size={tp_size} does not divide total_heads={total_heads}")
    if not 0 <= tp_rank < tp_size:
        raise ValueError(f"tp_rank={tp_rank} outside [0, {tp_size})")
    per = total_heads // tp_size
    return common_pb2.TensorParallelLayout(tp_size=tp_size, tp_rank=tp_rank, head_start=tp_rank * per,
                                           head_count=per, total_heads=total_heads)


def layout_problem(layout: common_pb2.TensorParallelLayout) -> str:
    """Why a layout is unusable, or '' when it is fine."""
    if layout.total_heads == 0 or layout.head_count == 0:
        return "total_heads and head_count must be > 0"
    if layout.head_start + layout.head_count > layout.total_heads:
        return (f"heads [{layout.head_start}, {layout.head_start + layout.head_count}) exceed "
                f"total_heads={layout.total_heads}")
    if layout.tp_size == 0 or layout.tp_rank >= layout.tp_size:
        return f"tp_rank={layout.tp_rank} outside tp_size={layout.tp_size}"
    return ""


def is_head_major(ref: common_pb2.PageRef) -> bool:
    return ref.kind in HEAD_MAJOR_KINDS


def head_bytes(ref: common_pb2.PageRef, layout: common_pb2.TensorParallelLayout) -> int:
    """Bytes of one head's range in a head-major page of a rank with `layout`."""
    if ref.num_bytes % layout.head_count:
        raise ValueError(f"page of {ref.num_bytes} bytes does not split into {layout.head_count} heads")
    return ref.num_bytes // layout.head_count


@dataclass(frozen=True)
class HeadRange:
    """One head's bytes of one page: where they sit in the producer's page."""

    head: int
    offset: int
    length: int


def head_ranges(ref: common_pb2.PageRef, layout: common_pb2.TensorParallelLayout) -> list[HeadRange]:
    """The per-head ranges a producer page is streamed as (one range for replicated MLA pages)."""
    if not is_head_major(ref):
        return [HeadRange(0, 0, ref.num_bytes)]
    size = head_bytes(ref, layout)
    return [HeadRange(layout.head_start + i, i * size, size) for i in range(layout.head_count)]


def page_key(ref: common_pb2.PageRef) -> tuple[int, int, int]:
    """What names a page across producer ranks (their lists differ by the replicated pages)."""
    return ref.kind, ref.group, ref.block_index


def head_major_refs(refs: Sequence[common_pb2.PageRef]) -> list[common_pb2.PageRef]:
    """The pages every producer rank sends (rank 0 sends the replicated ones too)."""
    return [ref for ref in refs if is_head_major(ref)]


@dataclass(frozen=True)
class ProducerPart:
    """Everything one producer rank delivered: its layout, page refs and verified page bytes."""

    layout: common_pb2.TensorParallelLayout
    refs: Sequence[common_pb2.PageRef]
    pages: Sequence[bytes | bytearray]

    @cached_property
    def index_of(self) -> dict[tuple[int, int, int], int]:
        """Position of each page in this part's own list."""
        return {page_key(ref): i for i, ref in enumerate(self.refs)}


def relayout_page(parts: Sequence[ProducerPart], page_index: int,
                  consumer: common_pb2.TensorParallelLayout) -> bytes:
    """The bytes of page `page_index` (of rank 0's list, the whole handle) as the consumer rank must hold them."""
    ref = parts[0].refs[page_index]
    if not is_head_major(ref):
        return bytes(parts[0].pages[page_index])
    out = bytearray()
    for head in range(consumer.head_start, consumer.head_start + consumer.head_count):
        part = _holder(parts, head)
        index = part.index_of[page_key(ref)]
        size = head_bytes(part.refs[index], part.layout)
        start = (head - part.layout.head_start) * size
        out += part.pages[index][start : start + size]
    return bytes(out)


def consumer_ref(parts: Sequence[ProducerPart], page_index: int, consumer: common_pb2.TensorParallelLayout,
                 data: bytes) -> common_pb2.PageRef:
    """The page ref the consumer sees: same position, its own byte count and fingerprint."""
    ref = common_pb2.PageRef()
    ref.CopyFrom(parts[0].refs[page_index])
    ref.num_bytes = len(data)
    ref.fingerprint = page_fingerprint(data)
    return ref


def _holder(parts: Sequence[ProducerPart], head: int) -> ProducerPart:
    for part in parts:
        if part.layout.head_start <= head < part.layout.head_start + part.layout.head_count:
            return part
    raise ValueError(f"no producer rank holds head {head}")


def check_parts_tile(parts: Sequence[ProducerPart]) -> str:
    """Producer parts (sorted by rank) must cover every head exactly once and agree on the pages: rank 0 sends
    the whole list, every other rank its head-major pages (or, from older producers, the whole list too);
    '' when they do."""
    first = parts[0]
    total = first.layout.total_heads
    covered = sorted((p.layout.head_start, p.layout.head_start + p.layout.head_count) for p in parts)
    position = 0
    for start, end in covered:
        if start != position:
            return f"producer head ranges do not tile [0, {total}): gap or overlap at head {position}"
        position = end
    if position != total:
        return f"producer head ranges cover [0, {position}) of {total} heads"
    whole = [page_key(ref) for ref in first.refs]
    head_major = [page_key(ref) for ref in head_major_refs(first.refs)]
    for part in parts[1:]:
        mine = [page_key(ref) for ref in part.refs]
        if mine != head_major and mine != whole:
            return (f"rank {part.layout.tp_rank} sent {len(mine)} pages that are neither rank "
                    f"{first.layout.tp_rank}'s head-major pages ({len(head_major)}) nor its whole list ({len(whole)})")
    return ""
