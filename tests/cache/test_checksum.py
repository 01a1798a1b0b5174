"""`hashing.checksum`, the integrity checksum of cached entries, against a pure-Python big-integer oracle,
and the property the checks rely on: any change within one 64-bit word changes it."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from k3core.cache.hashing import checksum

MOD = 1 << 64


def _signed(x: int) -> int:
    x %= MOD
    return x - MOD if x >= 1 << 63 else x


def oracle(data: bytes) -> int:
    """The definition, in Python integers: sum_i w_i * word_i mod 2^64 (signed), words little-endian int64 of
    the zero-padded bytes, w_i the odd splitmix64-style mix of i + 1 (arithmetic shifts, as on int64)."""
    padded = data + bytes(-len(data) % 8)
    total = 0
    for i in range(len(padded) // 8):
        word = int.from_bytes(padded[8 * i : 8 * i + 8], "little", signed=True)
        z = _signed((i + 1) * 0x9E3779B97F4A7C15)
        z = _signed((z ^ (z >> 31)) * 0xBF58476D1CE4E5B9)
        total += ((z ^ (z >> 29)) | 1) * word
    return _signed(total)


@settings(max_examples=60, deadline=None)
@given(st.binary(min_size=1, max_size=300))
def test_checksum_matches_the_python_oracle(data: bytes) -> None:
    assert checksum(torch.frombuffer(bytearray(data), dtype=torch.uint8)) == oracle(data)


@settings(max_examples=60, deadline=None)
@given(st.binary(min_size=1, max_size=300), st.data())
def test_any_change_within_one_word_changes_the_checksum(data: bytes, draw: st.DataObject) -> None:
    word = draw.draw(st.integers(0, (len(data) - 1) // 8))
    first, last = 8 * word, min(len(data), 8 * word + 8)
    mask = draw.draw(st.binary(min_size=last - first, max_size=last - first).filter(any))
    changed = bytearray(data)
    for i, m in enumerate(mask):
        changed[first + i] ^= m
    before = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    assert checksum(torch.frombuffer(changed, dtype=torch.uint8)) != checksum(before)


def test_views_and_dtypes_checksum_their_own_bytes() -> None:
    """A row of a pool tensor (offset storage) and a float32 tensor: the checksum of exactly their bytes."""
    pool = torch.arange(5 * 24, dtype=torch.uint8).reshape(5, 24)
    assert checksum(pool[2, :13]) == oracle(bytes(pool[2, :13].tolist()))
    assert checksum(pool[1, 3:19]) == oracle(bytes(pool[1, 3:19].tolist()))  # unaligned start
    values = torch.tensor([1.5, -2.0, 3.25])
    assert checksum(values) == oracle(values.numpy().tobytes())


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
