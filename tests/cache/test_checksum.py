"""`hashing.checksum`, the integrity checksum of cached entries: against a plain-Python big-integer oracle of
its definition (any chunking), and the properties the checks rely on: any single-bit flip, any two sign
flips (the weakness of the weighted word sum it replaced) and any swap of two different words change it."""

from __future__ import annotations

import itertools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from k3core.cache.hashing import checksum, checksum_lanes, checksum_rows, checksums, lanes_to_int
from k3core.cache.page_store import PageStore
from tests.support.mix_oracle import checksum as oracle


def tensor(data: bytes | bytearray) -> torch.Tensor:
    return torch.tensor(list(data), dtype=torch.uint8)


@settings(max_examples=60, deadline=None)
@given(st.binary(min_size=0, max_size=300), st.sampled_from([None, 1, 2, 3, 7]))
def test_checksum_matches_the_python_oracle_for_any_chunking(data: bytes, chunk_words: int | None) -> None:
    """Chunks of 1-7 words: most lengths are not multiples of the chunk (nor of a word)."""
    assert checksum(tensor(data), chunk_words) == oracle(data)


def test_lengths_across_the_default_chunk() -> None:
    """The default CPU chunk (2**15 words) with a partial last chunk and a partial last word."""
    data = torch.randint(0, 256, (2 * 4 * (1 << 15) + 4099,), dtype=torch.uint8,
                         generator=torch.Generator().manual_seed(1))
    assert checksum(data) == oracle(data.numpy().tobytes()) == checksum(data, 1000)


@settings(max_examples=60, deadline=None)
@given(st.binary(min_size=1, max_size=300), st.data())
def test_any_single_bit_flip_changes_the_checksum(data: bytes, draw: st.DataObject) -> None:
    bit = draw.draw(st.integers(0, 8 * len(data) - 1))
    changed = bytearray(data)
    changed[bit // 8] ^= 1 << bit % 8
    assert checksum(tensor(changed)) != checksum(tensor(data))


@settings(max_examples=60, deadline=None)
@given(st.binary(min_size=1, max_size=300), st.data())
def test_any_change_within_one_word_changes_the_checksum(data: bytes, draw: st.DataObject) -> None:
    word = draw.draw(st.integers(0, (len(data) - 1) // 4))
    first, last = 4 * word, min(len(data), 4 * word + 4)
    mask = draw.draw(st.binary(min_size=last - first, max_size=last - first).filter(any))
    changed = bytearray(data)
    for i, m in enumerate(mask):
        changed[first + i] ^= m
    assert checksum(tensor(changed)) != checksum(tensor(data))


@settings(max_examples=60, deadline=None)
@given(st.binary(min_size=16, max_size=256), st.data())
def test_two_sign_flips_change_the_checksum(data: bytes, draw: st.DataObject) -> None:
    """Bit 63 of two int64 words and bit 31 of two float32 values: a weighted sum cancels the former always."""
    for width in (8, 4):
        count = len(data) // width
        i, j = draw.draw(st.lists(st.integers(0, count - 1), min_size=2, max_size=2, unique=True))
        changed = bytearray(data)
        for k in (i, j):
            changed[width * k + width - 1] ^= 0x80
        assert checksum(tensor(changed)) != checksum(tensor(data))


@settings(max_examples=60, deadline=None)
@given(st.binary(min_size=8, max_size=256), st.data())
def test_swapping_two_different_words_changes_the_checksum(data: bytes, draw: st.DataObject) -> None:
    count = len(data) // 4
    i, j = draw.draw(st.lists(st.integers(0, count - 1), min_size=2, max_size=2, unique=True))
    words = [data[4 * k : 4 * k + 4] for k in range(count)]
    if words[i] == words[j]:
        return
    words[i], words[j] = words[j], words[i]
    assert checksum(tensor(b"".join(words) + data[4 * count :])) != checksum(tensor(data))


def test_every_pair_of_negated_floats_gives_a_distinct_checksum() -> None:
    """Exhaustive over a small float32 tensor: negating any two values (the old sum's blind spot: any two at
    odd indices) changes the checksum, and no two such corruptions collide with each other."""
    values = torch.randn(40, generator=torch.Generator().manual_seed(2))
    corrupted = []
    for i, j in itertools.combinations(range(values.numel()), 2):
        copy = values.clone()
        copy[[i, j]] *= -1
        corrupted.append(copy)
    prints = checksums([values, *corrupted])
    assert len(set(prints)) == len(prints) == 1 + 40 * 39 // 2


def test_padding_and_length_are_told_apart() -> None:
    assert checksum(tensor(b"\x01")) != checksum(tensor(b"\x01\x00")) != checksum(tensor(b"\x01\x00\x00\x00"))


def test_views_and_dtypes_checksum_their_own_bytes() -> None:
    """A row of a pool tensor (offset storage) and a float32 tensor: the checksum of exactly their bytes."""
    pool = torch.arange(5 * 24, dtype=torch.uint8).reshape(5, 24)
    assert checksum(pool[2, :13]) == oracle(bytes(pool[2, :13].tolist()))
    assert checksum(pool[1, 3:19]) == oracle(bytes(pool[1, 3:19].tolist()))  # unaligned start
    values = torch.tensor([1.5, -2.0, 3.25])
    assert checksum(values) == oracle(values.numpy().tobytes())


def test_batched_checksums_equal_single_ones_and_lanes_stay_on_the_device() -> None:
    pages = torch.randint(0, 256, (4, 101), dtype=torch.uint8, generator=torch.Generator().manual_seed(3))
    rows = [pages[0], pages[1, :50], pages[2, 1:], pages[3, :0]]
    assert checksums(rows) == [checksum(r) for r in rows] == [oracle(bytes(r.tolist())) for r in rows]
    assert checksums([]) == []
    lanes = checksum_lanes(pages[0])
    assert lanes.shape == (2,) and lanes.dtype == torch.int64 and lanes.device == pages.device


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 6), st.integers(1, 40), st.data())
def test_row_batched_checksums_equal_the_oracle_per_row(num_pages, page_bytes, draw: st.DataObject) -> None:
    """`checksum_rows` / `PageStore.fingerprints` (all pages through each column chunk together, the XOR lane
    folded once) against the per-row oracle: any rows (repeated, out of order), any byte count (a partial
    last word), any chunking (chunks narrower than a word per row, wider than the rows)."""
    pool = torch.randint(0, 256, (num_pages, page_bytes), dtype=torch.uint8,
                         generator=torch.Generator().manual_seed(num_pages * 100 + page_bytes))
    rows = draw.draw(st.lists(st.integers(0, num_pages - 1), max_size=8))
    nbytes = draw.draw(st.integers(0, page_bytes))
    chunk_words = draw.draw(st.sampled_from([None, 1, 2, 3, 5, 64]))
    expected = [oracle(bytes(pool[r, :nbytes].tolist())) for r in rows]
    lanes = checksum_rows(pool, rows, nbytes, chunk_words)
    assert lanes.shape == (len(rows), 2) and [lanes_to_int(pair) for pair in lanes.tolist()] == expected
    store = PageStore.__new__(PageStore)  # only its bytes are read
    store.data = pool
    assert store.fingerprints(rows, nbytes) == expected == [store.fingerprint(r, nbytes) for r in rows]


@pytest.mark.gpu
def test_device_checksum_equals_the_host_checksum():
    """Checksums taken on the GPU (pool pages) are compared with ones taken on the host (the CPU tier's copy
    of the same bytes) and back: both devices must compute the same function (int64 wrap-around, shifts)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    pages = torch.randint(0, 256, (3, 4099), dtype=torch.uint8, generator=torch.Generator().manual_seed(4))
    on_device = pages.cuda()
    for page, nbytes in ((0, 4099), (1, 4096), (2, 13)):
        assert checksum(on_device[page, :nbytes]) == checksum(pages[page, :nbytes]) == oracle(
            bytes(pages[page, :nbytes].tolist()))
    rows = [on_device[p, :n] for p, n in ((0, 4099), (1, 4096), (2, 13))]
    assert checksums(rows) == checksums([r.cpu() for r in rows]) == checksums(rows, 100)
    big = torch.randint(0, 256, ((1 << 25) + 7,), dtype=torch.uint8, generator=torch.Generator().manual_seed(5))
    assert checksum(big.cuda()) == checksum(big)  # several device chunks, a partial last word
    assert checksum_rows(on_device, [2, 0, 2], 4099, 100).cpu().equal(checksum_rows(pages, [2, 0, 2], 4099))
    store = PageStore.__new__(PageStore)
    store.data = on_device
    later = store.fingerprints_later([2, 0], 4099)  # pinned copy behind an event, no sync here
    assert later.result() == store.fingerprints([2, 0], 4099) == [checksum(pages[2]), checksum(pages[0])]
