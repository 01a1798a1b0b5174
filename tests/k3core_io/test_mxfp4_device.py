"""k3core.quant.mxfp4_device: the load-time device layout of MXFP4 codes (invertible, and each decoder
register is the stated lop3 of rotations)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from k3core.quant import mxfp4_device
from k3core.quant.mxfp4 import unpack_codes

WORDS = st.lists(st.integers(0, 255), min_size=4, max_size=64).filter(lambda b: len(b) % 4 == 0)


def _rotate(w: int, r: int) -> int:
    return ((w >> r) | (w << (32 - r))) & 0xFFFFFFFF if r else w


def _register_codes(word: int, rots: tuple[int, ...]) -> tuple[int, int]:
    """The two codes a decoder reads from one register: (sign, e1 e0 m0) of the low and the high half,
    computed here from the documented formula, independently of the module's matrices."""
    bits = 0
    for r in rots:
        bits ^= _rotate(word, r)
    bits &= mxfp4_device.PAIR_MASK
    return tuple(sum(((bits >> b) & 1) << (3 - f) for f, b in enumerate(half))
                 for half in mxfp4_device.PAIR_BITS)  # type: ignore[return-value]


@settings(max_examples=50, deadline=None)
@given(WORDS)
def test_device_words_round_trip_and_decode_to_the_codes(data):
    packed = torch.tensor(data, dtype=torch.uint8).reshape(1, -1)
    words = mxfp4_device.device_words(packed)
    assert words.dtype == torch.int32 and words.shape == (1, len(data) // 4)
    assert torch.equal(mxfp4_device.canonical_packed(words), packed)
    codes = unpack_codes(packed).reshape(-1, 8).tolist()
    for word, want in zip(words.reshape(-1).tolist(), codes, strict=True):
        for j, rots in enumerate(mxfp4_device.ROTATIONS):
            assert _register_codes(word & 0xFFFFFFFF, rots) == (want[j], want[j + 4])


def test_every_code_in_every_position():
    """Each of the 8 positions of a word holds each of the 16 codes once across these words."""
    codes = torch.stack([(torch.arange(16) + k) % 16 for k in range(8)], dim=1)  # [16 words, 8]
    packed = (codes[:, 0::2] | (codes[:, 1::2] << 4)).to(torch.uint8).reshape(1, -1)
    words = mxfp4_device.device_words(packed).reshape(-1).tolist()
    for word, want in zip(words, codes.tolist(), strict=True):
        got = [_register_codes(word & 0xFFFFFFFF, rots) for rots in mxfp4_device.ROTATIONS]
        assert [lo for lo, _ in got] + [hi for _, hi in got] == want


def test_decode_multipliers_are_the_scale_exponent_fields_capped_at_inf():
    scales = torch.tensor([0, 1, 34, 127, 160, 161, 200, 255], dtype=torch.uint8)
    fields = mxfp4_device.decode_multipliers(scales, shift=32).tolist()
    # bf16 exponent field of 2^(s - 1 - 32): s + 94, capped at 255 (+inf) from s = 161 on.
    assert fields == [94, 95, 128, 221, 254, 255, 255, 255]


def test_bad_inputs_are_refused():
    with pytest.raises(ValueError, match="divisible by 4"):
        mxfp4_device.device_words(torch.zeros(1, 6, dtype=torch.uint8))
    with pytest.raises(TypeError, match="uint8"):
        mxfp4_device.decode_multipliers(torch.zeros(2, dtype=torch.int32), shift=32)
