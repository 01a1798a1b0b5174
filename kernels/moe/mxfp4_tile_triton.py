"""MXFP4 weight tiles dequantised straight into bf16 tensor-core operands (Triton jit helpers).

An e2m1 code is s|e1 e0|m0. Placed with the sign at bit 15 and e1 e0 m0 at bits 8..6 of a bf16, it reads as
the code's value times 2^-126 exactly: e >= 1 codes become normal numbers, the subnormal e2m1 0.5 a bf16
subnormal. The packed bytes are read as 32-bit words of 8 codes (k3core.quant.mxfp4 puts element 2i in the
low nibble of byte i, so nibble j of a word is element j of its 8); nibbles j and j + 4 land in the two
halves of one register with two shifts and two masks, and one bf16x2 multiply by 2^(scale - 1 - SHIFT)
(built from the e8m0 byte with one integer multiply-add) applies the group's scale: 3-4 integer operations
and one multiply per two weights, no float32 conversion. The products carry a factor 2^-SHIFT (keeping
large scales inside bf16's range) that callers undo on their float32 accumulators: results are exact for
e8m0 scales in [2^-93, 2^33] (below, the smallest weights become bf16 subnormals); larger scales, the 0xFF
(NaN) code included, decode to +-inf (NaN for zero codes), so such a block makes the output non-finite as
the reference's NaN does.
"""

from __future__ import annotations

from kernels._triton import tl, triton

SHIFT = 32  # 2^-SHIFT rides on every decoded weight; accumulators are multiplied by 2^SHIFT at the end

if triton is not None:
    _SHIFT = tl.constexpr(SHIFT)

    @triton.jit
    def unshift(acc):
        """Float32 accumulators of products with `mxfp4_tile` weights -> the true sums (exact)."""
        return acc * (2.0**_SHIFT)

    @triton.jit
    def _multiplier(s):
        """e8m0 bytes (uint32) -> bf16 bits of 2^(s - 1 - SHIFT): a code's bf16 pattern (value x 2^-126) times
        this is value x 2^(s - 127 - SHIFT). Capped at +inf (bits 0x7F80) for scales above 2^(SHIFT + 1)."""
        return (tl.minimum(s, 129 + _SHIFT) + (126 - _SHIFT)) << 7

    @triton.jit
    def _pair_bits(w, J: tl.constexpr):
        """bf16 patterns (value x 2^-126) of nibbles J (low half) and J + 4 (high half) of uint32 words."""
        if J < 2:
            mag = w << (6 - 4 * J)
        else:
            mag = w >> (4 * J - 6)
        return (mag & 0x01C001C0) | ((w << (12 - 4 * J)) & 0x80008000)

    @triton.jit
    def _decode_portable(w, s):
        """Interpreter path: the same bf16 patterns widened to float32 bits (the interpreter flushes bf16
        subnormals), scaled in float32 (exact: a power of two)."""
        m = _multiplier(s)
        out = []
        for half in tl.static_range(2):
            for j in tl.static_range(4):
                bits = ((_pair_bits(w, j) >> (16 * half)) & 0xFFFF) << 16
                out.append((bits.to(tl.float32, bitcast=True) * (m << 16).to(tl.float32, bitcast=True))
                           .to(tl.bfloat16))
        return out[0], out[1], out[2], out[3], out[4], out[5], out[6], out[7]

    @triton.jit
    def _decode_ptx(w, s):
        """GPU path: per word, the multiplier in both halves (min, multiply-add), then four (shift, shift,
        mask, mask, or) pairs and four bf16x2 multiplies."""
        return tl.inline_asm_elementwise(
            """{
            .reg .b32 a, b, p, m;
            min.u32 m, $9, 161; mad.lo.u32 m, m, 0x00800080, 0x2F002F00;
            shl.b32 a, $8, 6; shl.b32 b, $8, 12; and.b32 a, a, 0x01C001C0; and.b32 b, b, 0x80008000;
            or.b32 p, a, b; mul.rn.bf16x2 p, p, m; mov.b32 {$0, $4}, p;
            shl.b32 a, $8, 2; shl.b32 b, $8, 8; and.b32 a, a, 0x01C001C0; and.b32 b, b, 0x80008000;
            or.b32 p, a, b; mul.rn.bf16x2 p, p, m; mov.b32 {$1, $5}, p;
            shr.b32 a, $8, 2; shl.b32 b, $8, 4; and.b32 a, a, 0x01C001C0; and.b32 b, b, 0x80008000;
            or.b32 p, a, b; mul.rn.bf16x2 p, p, m; mov.b32 {$2, $6}, p;
            shr.b32 a, $8, 6; and.b32 a, a, 0x01C001C0; and.b32 b, $8, 0x80008000;
            or.b32 p, a, b; mul.rn.bf16x2 p, p, m; mov.b32 {$3, $7}, p;
            }""",
            "=h,=h,=h,=h,=h,=h,=h,=h,r,r", [w, s], dtype=(tl.bfloat16,) * 8, is_pure=True,
            pack=1)

    @triton.jit
    def mxfp4_tile(words, scales, rows, row_ok, g0, WORDS: tl.constexpr, G: tl.constexpr,
                   USE_ASM: tl.constexpr):
        """bf16 [len(rows), 32 G] tile of weights x 2^-SHIFT, columns 32 g0 .. 32 (g0 + G), from a packed
        matrix of rows of WORDS uint32 words and its e8m0 scales (one byte per 4 words). Column order:
        position 8c + p holds column 8c + p // 2 + 4 (p % 2) (activations are loaded in the same order)."""
        w = tl.load(words + rows[:, None] * WORDS + g0 * 4 + tl.arange(0, 4 * G)[None, :],
                    mask=row_ok[:, None], other=0)
        w = tl.reshape(w, (rows.shape[0], G, 4)).to(tl.uint32, bitcast=True)
        s = tl.load(scales + rows[:, None] * (WORDS // 4) + g0 + tl.arange(0, G)[None, :],
                    mask=row_ok[:, None], other=0)
        s = tl.broadcast_to(s.to(tl.uint32)[:, :, None], w.shape)
        if USE_ASM:
            e0, e1, e2, e3, e4, e5, e6, e7 = _decode_ptx(w, s)
        else:
            e0, e1, e2, e3, e4, e5, e6, e7 = _decode_portable(w, s)
        # join appends the new axis last: the pairs (j, j + 4) that share a register stay adjacent (no byte
        # shuffles), which gives the column order above.
        low = tl.join(tl.join(e0, e2), tl.join(e1, e3))
        high = tl.join(tl.join(e4, e6), tl.join(e5, e7))
        return tl.reshape(tl.join(low, high), (rows.shape[0], 32 * G))
