"""MXFP4 weight tiles dequantised straight into bf16 tensor-core operands (Triton jit helpers).

An e2m1 code is s|e1 e0|m0. Placed with the sign at bit 15 and e1 e0 m0 at bits 8..6 of a bf16, it reads as
the code's value times 2^-126 exactly: e >= 1 codes become normal numbers, the subnormal e2m1 0.5 a bf16
subnormal. The weights come in k3core.quant.mxfp4_device's layout, prepared once at load time (`prepare`
below): per 32-bit word of 8 codes, register j (codes j and j + 4 as two bf16 patterns) is one `lop3` of one
or two rotations of the word, 8 integer operations per word. One bf16x2 multiply by 2^(scale - 1 - SHIFT)
per register applies the group's scale; its bf16 exponent field is also prepared at load time, so the
multiplier register is one integer multiply. The products carry a factor 2^-SHIFT (keeping large scales
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


def prepare(packed: torch.Tensor, scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Canonical MXFP4 (packed uint8 [..., K // 2], e8m0 scales [..., K // 32]) -> what `mxfp4_tile` reads:
    int32 words [..., K // 8] in the device layout and uint8 multiplier fields [..., K // 32]. Once per
    weight load; the same bytes."""
    return device_words(packed), decode_multipliers(scales, SHIFT)


def _decode_asm() -> str:
    """PTX of one word ($8) and multiplier field ($9) -> 8 bf16 ($j: code j, $j+4: code j + 4, the low and
    high halves of register j), from the layout's rotations and mask (nothing here is a hand-copied constant)."""
    rotations = sorted({r for rots in ROTATIONS for r in rots if r})
    lines = [".reg .b32 m, p" + "".join(f", r{r}" for r in rotations) + ";",
             f"mul.lo.u32 m, $9, {_FIELD_TO_BF16X2:#x};"]
    lines += [f"shf.r.wrap.b32 r{r}, $8, $8, {r};" for r in rotations]
    for j, rots in enumerate(ROTATIONS):
        a, b = (f"r{r}" if r else "$8" for r in (rots + rots)[:2])
        # lop3 truth tables over (a=0xF0, b=0xCC, c=0xAA): a & c, or (a ^ b) & c.
        lut = 0xA0 if len(rots) == 1 else 0x28
        lines += [f"lop3.b32 p, {a}, {b}, {PAIR_MASK:#x}, {lut:#x};",
                  f"mul.rn.bf16x2 p, p, m; mov.b32 {{${j}, ${j + 4}}}, p;"]
    return "{\n" + "\n".join(lines) + "\n}"


if triton is not None:
    _SHIFT = tl.constexpr(SHIFT)
    _MASK = tl.constexpr(PAIR_MASK)
    _ROTATIONS = tl.constexpr(ROTATIONS)
    _DECODE_ASM = tl.constexpr(_decode_asm())

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
        scale = (m << 23).to(tl.float32, bitcast=True)
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
        """GPU path: the multiplier, 4 rotations, and per register one lop3 and one bf16x2 multiply."""
        return tl.inline_asm_elementwise(_DECODE_ASM, "=h,=h,=h,=h,=h,=h,=h,=h,r,r", [w, m],
                                         dtype=(tl.bfloat16,) * 8, is_pure=True, pack=1)

    @triton.jit
    def mxfp4_tile(words, mults, rows, row_ok, g0, WORDS: tl.constexpr, G: tl.constexpr,
                   USE_ASM: tl.constexpr):
        """bf16 [len(rows), 32 G] tile of weights x 2^-SHIFT, columns 32 g0 .. 32 (g0 + G), from `prepare`'s
        words (rows of WORDS) and multiplier fields (one byte per 4 words). Column order: position 8c + p
        holds column 8c + p // 2 + 4 (p % 2) (activations are loaded in the same order)."""
        w = tl.load(words + rows[:, None] * WORDS + g0 * 4 + tl.arange(0, 4 * G)[None, :],
                    mask=row_ok[:, None], other=0)
        w = tl.reshape(w, (rows.shape[0], G, 4)).to(tl.uint32, bitcast=True)
        m = tl.load(mults + rows[:, None] * (WORDS // 4) + g0 + tl.arange(0, G)[None, :],
                    mask=row_ok[:, None], other=0)
        m = tl.broadcast_to(m.to(tl.uint32)[:, :, None], w.shape)
        if USE_ASM:
            e0, e1, e2, e3, e4, e5, e6, e7 = _decode_ptx(w, m)
        else:
            e0, e1, e2, e3, e4, e5, e6, e7 = _decode_portable(w, m)
        # join appends the new axis last: the pairs (j, j + 4) that share a register stay adjacent (no 16-bit
        # shuffles), which gives the column order above.
        low = tl.join(tl.join(e0, e2), tl.join(e1, e3))
        high = tl.join(tl.join(e4, e6), tl.join(e5, e7))
        return tl.reshape(tl.join(low, high), (rows.shape[0], 32 * G))
