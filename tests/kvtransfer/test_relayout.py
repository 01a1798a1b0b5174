"""Re-layout between TP degrees and the per-head chunk stream, against a global-content oracle."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from k3core.cache.hashing import fingerprint
from services.kvtransfer import relayout
from services.kvtransfer.chunks import FingerprintMismatch, PageAssembler, page_chunks
from tests.kvtransfer.pages import KDA, GlobalCache


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


@st.composite
def tp_pair(draw):
    heads = draw(st.sampled_from([1, 2, 4, 6, 8, 12]))
    return heads, draw(st.sampled_from(_divisors(heads))), draw(st.sampled_from(_divisors(heads)))


@settings(max_examples=40, deadline=None)
@given(tp_pair(), st.integers(0, 2**16), st.integers(1, 700), st.booleans())
def test_consumer_rank_gets_exactly_its_heads(pair, seed, max_chunk, whole):
    """Ranks > 0 send their KDA pages only (or, `whole`, every page as older producers did)."""
    heads, p, q = pair
    cache = GlobalCache.random(heads, seed, head_bytes=48, mla_bytes=100)
    parts = []
    for rank in range(p):
        handle, pages = cache.producer_part("h", p, rank, whole=whole)
        # Through the wire format: chunked per head, reassembled and verified.
        assembler = PageAssembler(handle)
        for chunk in page_chunks(handle, pages, max_chunk_bytes=max_chunk):
            assert not chunk.data or relayout.is_head_major(handle.pages[chunk.page_index]) or chunk.head == 0
            assembler.add(chunk)
        assert assembler.complete
        parts.append(relayout.ProducerPart(handle.layout, list(handle.pages), assembler.pages))
    assert relayout.check_parts_tile(parts) == ""
    for rank in range(q):
        consumer = relayout.rank_layout(heads, q, rank)
        expected = cache.rank_pages(consumer)
        for index in range(len(cache.kinds)):
            assert relayout.relayout_page(parts, index, consumer) == expected[index]


def test_fingerprint_matches_the_pool_fingerprint():
    data = torch.arange(1000, dtype=torch.float32)
    assert relayout.page_fingerprint(data.numpy().tobytes()) == fingerprint(data)


def test_flipped_byte_is_caught_and_only_that_page_is_wiped():
    cache = GlobalCache.random(4, seed=1)
    handle, pages = cache.producer_part("h", 2, 0)
    assembler = PageAssembler(handle)
    chunks = list(page_chunks(handle, pages, max_chunk_bytes=256))
    last_of_page_zero = max(i for i, c in enumerate(chunks) if c.page_index == 0)
    for chunk in chunks[: last_of_page_zero + 1]:
        assembler.add(chunk)
    bad = next(c for c in chunks if c.page_index == 1)
    bad.data = bytes([bad.data[0] ^ 1]) + bad.data[1:]
    with pytest.raises(FingerprintMismatch):
        for chunk in chunks[last_of_page_zero + 1:]:
            assembler.add(chunk)
    assert assembler.verified_prefix == 1 and assembler.verified[0]
    for chunk in page_chunks(handle, pages, start=1):  # the resumed stream
        assembler.add(chunk)
    assert assembler.complete and [bytes(p) for p in assembler.pages] == pages


def test_parts_that_do_not_tile_are_refused():
    cache = GlobalCache.random(4, seed=2)
    h0, p0 = cache.producer_part("h", 2, 0)
    parts = [relayout.ProducerPart(h0.layout, list(h0.pages), p0)] * 2
    assert "tile" in relayout.check_parts_tile(parts)


def test_parts_whose_page_lists_disagree_are_refused():
    cache = GlobalCache.random(4, seed=3)
    h0, p0 = cache.producer_part("h", 2, 0)
    h1, p1 = cache.producer_part("h", 2, 1)
    assert [r.kind for r in h1.pages] == [KDA] * 3  # rank 1 sends its KDA pages only
    rank0 = relayout.ProducerPart(h0.layout, list(h0.pages), p0)
    assert relayout.check_parts_tile([rank0, relayout.ProducerPart(h1.layout, list(h1.pages), p1)]) == ""
    missing = relayout.ProducerPart(h1.layout, list(h1.pages)[:-1], p1[:-1])
    assert "head-major" in relayout.check_parts_tile([rank0, missing])
    one_mla = relayout.ProducerPart(h1.layout, [h0.pages[0], *h1.pages], [p0[0], *p1])
    assert "whole list" in relayout.check_parts_tile([rank0, one_mla])
