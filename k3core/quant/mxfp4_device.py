"""A device layout of MXFP4 codes, prepared once at load time, that a GPU decodes in 2 operations per pair.

The canonical pack (k3core.quant.mxfp4) stays the storage and checkpoint format; this is an additive,
invertible re-arrangement of each 32-bit word of 8 codes (same bytes, same size). A decoder wants, per
word, four registers of two bf16 bit patterns: register j holds code j in its low half and code j + 4 in
its high half (the decoder permutes the other operand to match; codes 2j, 2j + 1 took more instructions
offline in every form tried, Triton and Gluon, weights as either MMA operand: the moves that assemble the
tensor-core operands cost more than the activations' permutes; docs/kernels.md history 35), each with the
sign at bit 15 and e1 e0 m0 at bits 8..6 of its half (the code's value x 2^-126; see
kernels.moe.mxfp4_tile_triton). From a canonical word that takes two shifts, two masks and an
or per register. Here each register is one `lop3` of one or two rotations of the stored word:

    reg_j = (rot(w, a_j) ^ rot(w, b_j)) & PAIR_MASK          (rot: rotate right; rot(w, 0) = w)

with the rotations below. No choice of 4 rotations alone tiles the 32 bits (the pattern {6, 7, 8, 15} does
not tile Z_16), so two registers combine two rotations; the map from w to the four registers is linear
and invertible over GF(2), and the stored word is its inverse applied to the wanted bits. Cost per word:
4 rotations (one is shared) and 4 lop3, against 15 integer operations from the canonical word.
"""

from __future__ import annotations

import functools

import torch

# Bits of a register that hold a pair: (sign, e1, e0, m0) of the low and the high half.
PAIR_BITS = ((15, 8, 7, 6), (31, 24, 23, 22))
PAIR_MASK = sum(1 << b for half in PAIR_BITS for b in half)
# Register j = (rot(w, a) ^ rot(w, b)) & PAIR_MASK for ROTATIONS[j] = (a, b); (a,) is rot(w, a) & PAIR_MASK.
# Found by search: every register a lop3 of at most two rotations, among 4 distinct non-zero rotations.
ROTATIONS: tuple[tuple[int, ...], ...] = ((0,), (12,), (2, 6), (2, 8))


def _rows() -> list[int]:
    """Row k of the 32x32 GF(2) matrix (as an int: bit i set when output bit k reads stored bit i). Output
    bit k = 8 j + 4 half + f is field f (sign, e1, e0, m0) of code j + 4 half."""
    rows = []
    for rots in ROTATIONS:
        for half in PAIR_BITS:
            for p in half:
                row = 0
                for r in rots:
                    row ^= 1 << ((p + r) % 32)
                rows.append(row)
    return rows


def _invert(rows: list[int]) -> list[int]:
    """Inverse of a 32x32 GF(2) matrix given as row bit masks (Gauss-Jordan on [A | I])."""
    aug = [(row, 1 << k) for k, row in enumerate(rows)]
    for col in range(32):
        pivot = next((i for i in range(col, 32) if aug[i][0] >> col & 1), None)
        if pivot is None:
            raise ValueError("ROTATIONS give a singular layout")
        aug[col], aug[pivot] = aug[pivot], aug[col]
        for i in range(32):
            if i != col and aug[i][0] >> col & 1:
                aug[i] = (aug[i][0] ^ aug[col][0], aug[i][1] ^ aug[col][1])
    return [inv for _, inv in aug]


@functools.cache
def _inverse_rows() -> tuple[int, ...]:
    """Row i: which output bits XOR into stored bit i."""
    return tuple(_invert(_rows()))


def _apply(rows: tuple[int, ...] | list[int], bits: torch.Tensor) -> torch.Tensor:
    """y_i = parity(bits & rows[i]) for 32 rows, on int64 tensors holding 32-bit values."""
    out = torch.zeros_like(bits)
    for i, mask in enumerate(rows):
        x = bits & mask
        for shift in (16, 8, 4, 2, 1):
            x = x ^ (x >> shift)
        out |= (x & 1) << i
    return out


def _field_bits(codes: torch.Tensor) -> torch.Tensor:
    """int64 codes [..., 8] -> the 32 wanted output bits per word (bit 8 j + 4 half + f, see _rows)."""
    out = torch.zeros(codes.shape[:-1], dtype=torch.int64, device=codes.device)
    for j in range(4):
        for half in range(2):
            code = codes[..., j + 4 * half]
            for f in range(4):
                out |= ((code >> (3 - f)) & 1) << (8 * j + 4 * half + f)
    return out


def _as_int32(values: torch.Tensor) -> torch.Tensor:
    return torch.where(values >= 1 << 31, values - (1 << 32), values).to(torch.int32)


def _word_codes(packed: torch.Tensor) -> torch.Tensor:
    """Canonical packed uint8 [..., K // 2] -> int64 codes [..., K // 8, 8] in element order, a word's 8 a row."""
    if packed.dtype != torch.uint8 or packed.shape[-1] % 4:
        raise ValueError(f"packed MXFP4 must be uint8 with a last dim divisible by 4, got {packed.dtype} "
                         f"{tuple(packed.shape)}")
    b = packed.to(torch.int64).unflatten(-1, (-1, 4))
    return torch.stack([b & 0x0F, b >> 4], dim=-1).flatten(-2)


def device_words(packed: torch.Tensor) -> torch.Tensor:
    """Canonical packed uint8 [..., K // 2] -> int32 [..., K // 8] words of the device layout."""
    return _as_int32(_apply(_inverse_rows(), _field_bits(_word_codes(packed))))


def canonical_packed(words: torch.Tensor) -> torch.Tensor:
    """Inverse of device_words: int32 [..., K // 8] -> canonical uint8 [..., K // 2]."""
    fields = _apply(_rows(), words.to(torch.int64) & 0xFFFFFFFF)
    codes = torch.stack([sum(((fields >> (8 * j + 4 * half + f)) & 1) << (3 - f) for f in range(4))
                         for half in range(2) for j in range(4)], dim=-1)
    return (codes[..., 0::2] | (codes[..., 1::2] << 4)).to(torch.uint8).flatten(-2)


def decode_multipliers(scales: torch.Tensor, shift: int) -> torch.Tensor:
    """e8m0 scales uint8 -> uint8 bf16 exponent fields of 2^(s - 1 - shift), capped at 255 (+inf): a code's
    pattern (value x 2^-126) times that bf16 is value x 2^(s - 127 - shift). Prepared at load time, so the
    decoder builds the multiplier register with one integer multiply (field x 0x00800080)."""
    if scales.dtype != torch.uint8:
        raise TypeError(f"MXFP4 scales must be uint8 (e8m0), got {scales.dtype}")
    if not 0 <= 126 - shift <= 126:
        raise ValueError(f"shift must be in [0, 126], got {shift}")
    return (scales.to(torch.int32).clamp(max=129 + shift) + (126 - shift)).to(torch.uint8)


# --- e4m3 layout (kernels.moe.decode_fp8_gluon): a word of 8 codes -> 2 registers of 4 e4m3 bytes -------------
# An e2m1 code s|e1 e0|m0 with s at bit 7 and e1 e0 m0 at bits 4..2 of a byte reads as an e4m3 number equal to
# the code's value x 2^-6 exactly (e = 0, m = 1: the e4m3 subnormal 2^-7). Register j holds codes 4 j .. 4 j + 3,
# code 4 j + i in byte i; register j = (rot(w, a) [^ rot(w, b)]) & E4M3_MASK for E4M3_ROTATIONS[j] = (a[, b]):
# 4 integer operations a word (found by search; no two single rotations tile the byte pattern {7, 4, 3, 2}).
E4M3_BITS = (7, 4, 3, 2)  # sign, e1, e0, m0 of a code inside its byte
E4M3_MASK = sum(1 << (8 * i + b) for i in range(4) for b in E4M3_BITS)
E4M3_ROTATIONS: tuple[tuple[int, ...], ...] = ((0,), (2, 4))
E4M3_EXPONENT = -6  # a decoded byte is the code's value x 2^E4M3_EXPONENT


def _e4m3_rows() -> list[int]:
    """As `_rows` for the e4m3 layout: output bit k = 16 j + 4 i + f is field f (sign, e1, e0, m0) of code
    4 j + i."""
    rows = []
    for rots in E4M3_ROTATIONS:
        for i in range(4):
            for b in E4M3_BITS:
                row = 0
                for r in rots:
                    row ^= 1 << ((8 * i + b + r) % 32)
                rows.append(row)
    return rows


@functools.cache
def _e4m3_inverse_rows() -> tuple[int, ...]:
    return tuple(_invert(_e4m3_rows()))


def device_words_e4m3(packed: torch.Tensor) -> torch.Tensor:
    """Canonical packed uint8 [..., K // 2] -> int32 [..., K // 8] words of the e4m3 layout."""
    codes = _word_codes(packed)
    fields = torch.zeros(codes.shape[:-1], dtype=torch.int64, device=codes.device)
    for c in range(8):
        for f in range(4):
            fields |= ((codes[..., c] >> (3 - f)) & 1) << (4 * c + f)
    return _as_int32(_apply(_e4m3_inverse_rows(), fields))


def decode_e4m3(words: torch.Tensor) -> torch.Tensor:
    """What a GPU computes from e4m3-layout words: int32 [..., W] -> uint8 e4m3 bytes [..., 8 W] in element
    order (code c of word w at 8 w + c; view as torch.float8_e4m3fn for the values x 2^-6)."""
    if words.dtype != torch.int32:
        raise TypeError(f"e4m3-layout words must be int32 (device_words_e4m3's output), got {words.dtype}")
    w = words.to(torch.int64) & 0xFFFFFFFF
    regs = []
    for rots in E4M3_ROTATIONS:
        reg = torch.zeros_like(w)
        for r in rots:
            reg ^= ((w >> r) | (w << (32 - r))) & 0xFFFFFFFF
        regs.append(reg & E4M3_MASK)
    return torch.stack([(reg >> (8 * i)) & 0xFF for reg in regs for i in range(4)], dim=-1).flatten(-2).to(torch.uint8)


def e4m3_multipliers(scales: torch.Tensor) -> torch.Tensor:
    """e8m0 scales uint8 -> uint8 float32 exponent fields of 2^(s - 127 - E4M3_EXPONENT), capped at 255 (+inf;
    the 0xFF NaN scale included, so such a block makes the output non-finite as the reference's NaN does): a
    decoder's multiplier is the field << 23 as float32 bits, one integer operation."""
    if scales.dtype != torch.uint8:
        raise TypeError(f"MXFP4 scales must be uint8 (e8m0), got {scales.dtype}")
    return (scales.to(torch.int32) - E4M3_EXPONENT).clamp(max=255).to(torch.uint8)
