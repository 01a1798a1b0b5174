"""MXFP4 weight tiles dequantised straight into bf16 tensor-core operands (Triton jit helpers).

An e2m1 code is s|e1 e0|m0. Placed with the sign at bit 15 and e1 e0 m0 at bits 8..6 of a bf16, it reads as
the code's value times 2^-126 exactly: e >= 1 codes become normal numbers, the subnormal e2m1 0.5 a bf16
subnormal. The weights come in k3core.quant.mxfp4_device's layout, prepared once at load time (`prepare`
below): per 32-bit word of 8 codes, register j (codes j and j + 4 as two bf16 patterns) is one `lop3` of one
or two rotations of the word, 8 integer operations per word. One bf16x2 multiply by 2^(scale - 1 - SHIFT)
per register applies the group's scale; its bf16 exponent field is also prepared at load time, so the
multiplier register is one integer multiply, and the words are ordered so that the words a tensor-core
lane holds share a group: one multiplier per 4 words. The products carry a factor 2^-SHIFT (keeping large scales
inside bf16's range) that callers undo on their float32 accumulators: results are exact for e8m0 scales in
[2^-93, 2^33] (below, the smallest weights become bf16 subnormals); larger scales, the 0xFF (NaN) code
included, decode to +-inf (NaN for zero codes), so such a block makes the output non-finite as the
reference's NaN does.
"""

from __future__ import annotations

import torch

from k3core.quant.mxfp4_device import PAIR_MASK, ROTATIONS, decode_multipliers, device_words
from kernels._triton import tl, triton

SHIFT = 32  # 2^-SHIFT rides on every decoded weight; accumulators are multiplied by 2^SHIFT at the end
# A bf16 exponent field f in both halves of a register: f << 7 | f << 23.
_FIELD_TO_BF16X2 = (1 << 7) | (1 << 23)


BLOCK_ROWS = 32  # rows of a stored block (both MXFP4 matrices of an expert have a multiple of 32 rows)


def block_words(words: int) -> int:
    """Words per row of a stored block, for rows of `words` words: 16 (128 columns: a block is 2 KB of words
    and 128 bytes of multipliers) where that divides the row, else 8 or 4 (rows of MXFP4 words: a multiple of
    4)."""
    return next(cw for cw in (16, 8, 4) if words % cw == 0)


def _blocked(t: torch.Tensor, cols: int) -> torch.Tensor:
    """[..., R, C] -> the same shape, stored as [..., R / BLOCK_ROWS, C / cols, BLOCK_ROWS, cols] blocks."""
    *lead, rows, width = t.shape
    b = t.reshape(*lead, rows // BLOCK_ROWS, BLOCK_ROWS, width // cols, cols).transpose(-3, -2)
    return b.contiguous().reshape(t.shape)


def prepare(packed: torch.Tensor, scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Canonical MXFP4 (packed uint8 [..., R, K // 2], e8m0 scales [..., R, K // 32]) -> what `mxfp4_tile`
    reads, once per weight load (the same bytes): int32 words [..., R, K // 8] in the device layout and uint8
    multiplier fields [..., R, K // 32], both stored in blocks of BLOCK_ROWS rows x `block_words(K // 8)`
    words (and their multipliers), so that a tile step reads whole contiguous blocks (2 KB) instead of
    64-byte pieces of 32-128 rows 1 KB apart (measured against whole rows: docs/kernels.md, history 25)."""
    if packed.shape[-2] % BLOCK_ROWS:
        raise ValueError(f"blocked MXFP4 needs a multiple of {BLOCK_ROWS} rows, got {packed.shape[-2]}")
    words, mults = device_words(packed), decode_multipliers(scales, SHIFT)
    cw = block_words(words.shape[-1])
    return _blocked(words, cw), _blocked(mults, cw // 4)


def _decode_asm() -> str:
    """PTX of one word ($8) and its bf16x2 multiplier ($9) -> 8 bf16 ($j: code j, $j+4: code j + 4, the low and
    high halves of register j), from the layout's rotations and mask (nothing here is a hand-copied constant)."""
    rotations = sorted({r for rots in ROTATIONS for r in rots if r})
    lines = [".reg .b32 p" + "".join(f", r{r}" for r in rotations) + ";"]
    lines += [f"shf.r.wrap.b32 r{r}, $8, $8, {r};" for r in rotations]
    for j, rots in enumerate(ROTATIONS):
        a, b = (f"r{r}" if r else "$8" for r in (rots + rots)[:2])
        # lop3 truth tables over (a=0xF0, b=0xCC, c=0xAA): a & c, or (a ^ b) & c.
        lut = 0xA0 if len(rots) == 1 else 0x28
        lines += [f"lop3.b32 p, {a}, {b}, {PAIR_MASK:#x}, {lut:#x};",
                  f"mul.rn.bf16x2 p, p, $9; mov.b32 {{${j}, ${j + 4}}}, p;"]
    return "{\n" + "\n".join(lines) + "\n}"


if triton is not None:
    _SHIFT = tl.constexpr(SHIFT)
    _MASK = tl.constexpr(PAIR_MASK)
    _ROTATIONS = tl.constexpr(ROTATIONS)
    _DECODE_ASM = tl.constexpr(_decode_asm())
    _FIELDS_TO_BF16X2 = tl.constexpr(_FIELD_TO_BF16X2)
    _BLOCK_ROWS = tl.constexpr(BLOCK_ROWS)
    _block_words = triton.constexpr_function(block_words)

    @triton.jit
    def unshift(acc):
        """Float32 accumulators of products with `mxfp4_tile` weights -> the true sums (exact)."""
        return acc * (2.0**_SHIFT)

    @triton.jit
    def _rotate(w, r: tl.constexpr):
        if r == 0:
            return w
        return (w >> r) | (w << (32 - r))

    @triton.jit
    def _decode_portable(w, m):
        """Interpreter path: the PTX's registers, each half widened to float32 bits (the interpreter flushes
        bf16 subnormals), scaled in float32 (exact: a power of two)."""
        scale = ((m & 0xFFFF) << 16).to(tl.float32, bitcast=True)
        low = []
        high = []
        for j in tl.static_range(4):
            rots = _ROTATIONS[j]
            bits = _rotate(w, rots[0])
            if len(rots) == 2:
                bits = bits ^ _rotate(w, rots[1])
            bits = bits & _MASK
            for half in tl.static_range(2):
                value = ((((bits >> (16 * half)) & 0xFFFF) << 16).to(tl.float32, bitcast=True) * scale)
                if half == 0:
                    low.append(value.to(tl.bfloat16))
                else:
                    high.append(value.to(tl.bfloat16))
        return low[0], low[1], low[2], low[3], high[0], high[1], high[2], high[3]

    @triton.jit
    def _decode_ptx(w, m):
        """GPU path: 4 rotations, and per register one lop3 and one bf16x2 multiply."""
        return tl.inline_asm_elementwise(_DECODE_ASM, "=h,=h,=h,=h,=h,=h,=h,=h,r,r", [w, m],
                                         dtype=(tl.bfloat16,) * 8, is_pure=True, pack=1)

    @triton.jit
    def _lane_groups(t, G: tl.constexpr):
        """[R, G, 4] (group, word of the group) -> [R, 4 G] word slots such that the 8-column chunk
        a thread holds in each 32-column block of a tensor-core operand (the q-th of 4 in block 4a + b) is
        word b of group 4a + q: the G words of a thread share G / 4 scales, so its multipliers are built
        once per 4 words (when G % 4 == 0; else the identity)."""
        if G % 4 == 0:
            t = tl.permute(tl.reshape(t, (t.shape[0], G // 4, 4, 4)), (0, 1, 3, 2))
        return tl.reshape(t, (t.shape[0], 4 * G))

    @triton.jit
    def lane_group_columns(a, G: tl.constexpr):
        """Columns of a [BT, 32 G] operand in `mxfp4_tile`'s order: word slots as `_lane_groups`, then within
        each word of 8 columns position p holds column p // 2 + 4 (p % 2)."""
        BT: tl.constexpr = a.shape[0]
        if G % 4 == 0:
            a = tl.permute(tl.reshape(a, (BT, G // 4, 4, 4, 8)), (0, 1, 3, 2, 4))
        return tl.reshape(tl.permute(tl.reshape(a, (BT, 4 * G, 2, 4)), (0, 1, 3, 2)), (BT, 32 * G))

    @triton.jit
    def block_offsets(rows, cols, WIDTH: tl.constexpr, CB: tl.constexpr):
        """[len(rows), len(cols)] element offsets of a [R, WIDTH] matrix stored as `_blocked` [BLOCK_ROWS, CB]
        blocks (CB = WIDTH: row by row); a row part and a column part, so the row part leaves the loop."""
        col_part = (cols // CB) * (_BLOCK_ROWS * CB) + cols % CB
        if CB >= cols.shape[0]:  # a step inside one block: its columns stay contiguous and aligned
            col_part = tl.max_contiguous(tl.multiple_of(col_part, cols.shape[0]), cols.shape[0])
        row_part = (rows // _BLOCK_ROWS) * (_BLOCK_ROWS * WIDTH) + (rows % _BLOCK_ROWS) * CB
        return row_part[:, None] + col_part[None, :]

    @triton.jit
    def mxfp4_tile(words, mults, rows, row_ok, g0, WORDS: tl.constexpr, G: tl.constexpr, USE_ASM: tl.constexpr):
        """bf16 [len(rows), 32 G] tile of weights x 2^-SHIFT, columns 32 g0 .. 32 (g0 + G), from `prepare`'s
        words (rows of WORDS in blocks of CW = `block_words(WORDS)` words) and multiplier fields (one byte
        per 4 words), in the column order of `lane_group_columns` (activations go through it)."""
        R: tl.constexpr = rows.shape[0]
        CW: tl.constexpr = _block_words(WORDS)
        w = tl.load(words + block_offsets(rows, g0 * 4 + tl.arange(0, 4 * G), WORDS, CW), mask=row_ok[:, None],
                    other=0)
        w = _lane_groups(tl.reshape(w, (R, G, 4)).to(tl.uint32, bitcast=True), G)
        f = tl.load(mults + block_offsets(rows, g0 + tl.arange(0, G), WORDS // 4, CW // 4),
                    mask=row_ok[:, None], other=0)
        m = _lane_groups(tl.broadcast_to((f.to(tl.uint32) * _FIELDS_TO_BF16X2)[:, :, None], (R, G, 4)), G)
        if USE_ASM:
            e0, e1, e2, e3, e4, e5, e6, e7 = _decode_ptx(w, m)
        else:
            e0, e1, e2, e3, e4, e5, e6, e7 = _decode_portable(w, m)
        # join appends the new axis last: the pairs (j, j + 4) that share a register stay adjacent (no 16-bit
        # shuffles), which gives the order within each word above.
        low = tl.join(tl.join(e0, e2), tl.join(e1, e3))
        high = tl.join(tl.join(e4, e6), tl.join(e5, e7))
        return tl.reshape(tl.join(low, high), (R, 32 * G))
