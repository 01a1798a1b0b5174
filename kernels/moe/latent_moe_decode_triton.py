"""Routed-expert decode with MXFP4 weights streamed and dequantised on the fly (§5.4.2, WarpDecode idea).

At decode batch sizes a grouped GEMM degenerates into streaming weight matrices, so the work is cut by
output rows: program (pair, row block) streams BR packed rows of one expert. Expert-centric: the program of
the first (token, expert) pair that names an expert serves every token routed to it (the others exit at
once), so an expert's weights leave DRAM once per step however many tokens share it; the rows are re-read
from L2 for the second and later tokens.

Dequantisation works on 32-bit words of 8 e2m1 codes (k3core.quant.mxfp4 packs element 2i in the low
nibble of byte i, so nibble k of word c is element 8c + k). Nibbles k and k+4 become one pair of fp16 bit
patterns with two shifts and masks (magnitude to bits 9-11, sign to bit 15): that fp16 is the e2m1 value
times 2^-14, exact for all eight magnitudes, the subnormal 0.5 included. Both halves are widened to float32
and multiplied into float32 sums; the e8m0 scale (and 2^14) is applied once per 32 elements.
Kernel 1: gate and up rows -> SiTU-GLU -> h [T*k, F]. Kernel 2: down rows times the router weight
-> [T*k, l]. Kernel 3: the k rows of each token summed into u [T, l] in x's dtype.
"""

from __future__ import annotations

import torch

from kernels._triton import next_pow2, require, tl, triton

if triton is not None:
    from kernels.moe.situ_glu_triton import situ_glu_values

    @triton.jit
    def _e2m1_pair(w, K: tl.constexpr):
        """Nibbles K and K+4 of each uint32 word as two fp16 bit patterns (value * 2^-14) in one word."""
        if K == 3:
            return ((w >> 3) & 0x0E000E00) | (w & 0x80008000)
        else:
            return ((w << (9 - 4 * K)) & 0x0E000E00) | ((w << (12 - 4 * K)) & 0x80008000)

    @triton.jit
    def _halves(pair, USE_ASM: tl.constexpr):
        """The two fp16 halves of a word, widened to float32 (PTX on the GPU: a register split and two
        conversions; the interpreter takes the portable masks and shifts)."""
        if USE_ASM:
            lo, hi = tl.inline_asm_elementwise(
                "{ .reg .b16 xl, xh; mov.b32 {xl, xh}, $2; cvt.f32.f16 $0, xl; cvt.f32.f16 $1, xh; }",
                "=r,=r,r", [pair], dtype=(tl.float32, tl.float32), is_pure=True, pack=1)
        else:
            lo = (pair & 0xFFFF).to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)
            hi = (pair >> 16).to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)
        return lo, hi

    @triton.jit
    def _load_tile(words, scales, rows, row_ok, c0, WORDS: tl.constexpr, BW: tl.constexpr):
        """Words c0..c0+BW of the given rows (a row has WORDS words) and their e8m0 scales."""
        w = tl.load(words + rows[:, None] * WORDS + (c0 + tl.arange(0, BW))[None, :], mask=row_ok[:, None], other=0)
        s = tl.load(scales + rows[:, None] * (WORDS // 4) + (c0 // 4 + tl.arange(0, BW // 4))[None, :],
                    mask=row_ok[:, None], other=0)
        return w, s

    @triton.jit
    def _tile_dot(w, s, vec, c0, BR: tl.constexpr, BW: tl.constexpr, USE_ASM: tl.constexpr):
        """sum_c W[row, c] vec[c] over the 8*BW columns of a tile from `_load_tile`: [BR]."""
        cw = c0 + tl.arange(0, BW)
        w = w.to(tl.uint32, bitcast=True)
        part = tl.zeros([BR, BW], dtype=tl.float32)
        for k in tl.static_range(4):
            lo, hi = _halves(_e2m1_pair(w, k), USE_ASM)
            part += lo * tl.load(vec + cw * 8 + k).to(tl.float32)[None, :]
            part += hi * tl.load(vec + cw * 8 + k + 4).to(tl.float32)[None, :]
        groups = tl.sum(tl.reshape(part, (BR, BW // 4, 4)), 2)  # 4 words = one 32-element scale group
        return tl.sum(groups * tl.exp2(s.to(tl.float32) - 113.0), 1)  # 2^(s - 127) times the fp16 trick's 2^14

    @triton.jit
    def _routes(ids, pair, T, K, BT: tl.constexpr, BK: tl.constexpr):
        """For the expert of `pair`: whether `pair` is its first pair (the leader), and per token the
        first pair routed to it and a mask of any further (duplicate) pairs of that token."""
        e = tl.load(ids + pair)
        tok, slot = tl.arange(0, BT), tl.arange(0, BK)
        index = tok[:, None] * K + slot[None, :]
        match = tl.load(ids + index, mask=(tok[:, None] < T) & (slot[None, :] < K), other=-1) == e
        first = tl.min(tl.where(match, index, 1 << 30), 1)  # [BT], 1<<30 where the token skips e
        leader = tl.min(first, 0) == pair
        return e.to(tl.int64), leader, first, match & (index != first[:, None]), index

    @triton.jit
    def _step(it, rb0, n_rows, ITERS: tl.constexpr, WORDS: tl.constexpr, BR: tl.constexpr, BW: tl.constexpr):
        """Rows and first word of step `it` of a program's walk over RB row blocks x WORDS // BW column
        blocks; rows past the matrix or past the last step are masked."""
        rows = (rb0 + it // (WORDS // BW)) * BR + tl.arange(0, BR)
        return rows, (rows < n_rows) & (rows * 0 + it < ITERS), (it % (WORDS // BW)) * BW

    @triton.jit
    def _gate_up_kernel(x, ids, wgu, sgu, h, T, K, F, beta1, beta2, L: tl.constexpr, BR: tl.constexpr,
                        BW: tl.constexpr, RB: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr,
                        USE_ASM: tl.constexpr):
        pair = tl.program_id(0)
        rb0 = tl.program_id(1) * RB
        e, leader, first, _, _ = _routes(ids, pair, T, K, BT, BK)
        ITERS = RB * (L // 8 // BW)
        if leader:
            words, scales = wgu + e * (2 * F) * (L // 8), sgu + e * (2 * F) * (L // 32)
            for t in range(T):
                p = tl.sum(tl.where(tl.arange(0, BT) == t, first, 0))
                if p < (1 << 30):
                    # Each step loads the next step's tiles before it computes its own (register double
                    # buffering), so a program always has a load in flight.
                    rows, ok, c0 = _step(0, rb0, F, ITERS, L // 8, BR, BW)
                    wg, sg = _load_tile(words, scales, rows, ok, c0, L // 8, BW)
                    wu, su = _load_tile(words, scales, rows + F, ok, c0, L // 8, BW)
                    g = tl.zeros([BR], dtype=tl.float32)
                    u = tl.zeros([BR], dtype=tl.float32)
                    for it in range(ITERS):
                        rows, ok, c0 = _step(it, rb0, F, ITERS, L // 8, BR, BW)
                        n_rows, n_ok, n_c0 = _step(it + 1, rb0, F, ITERS, L // 8, BR, BW)
                        wg_next, sg_next = _load_tile(words, scales, n_rows, n_ok, n_c0, L // 8, BW)
                        wu_next, su_next = _load_tile(words, scales, n_rows + F, n_ok, n_c0, L // 8, BW)
                        g += _tile_dot(wg, sg, x + t * L, c0, BR, BW, USE_ASM)
                        u += _tile_dot(wu, su, x + t * L, c0, BR, BW, USE_ASM)
                        if c0 + BW == L // 8:
                            tl.store(h + p.to(tl.int64) * F + rows, situ_glu_values(g, u, beta1, beta2), mask=ok)
                            g = tl.zeros([BR], dtype=tl.float32)
                            u = tl.zeros([BR], dtype=tl.float32)
                        wg, sg, wu, su = wg_next, sg_next, wu_next, su_next

    @triton.jit
    def _down_kernel(h, ids, weights, wd, sd, partial, T, K, F: tl.constexpr, L, BR: tl.constexpr,
                     BW: tl.constexpr, RB: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr,
                     USE_ASM: tl.constexpr):
        pair = tl.program_id(0)
        rb0 = tl.program_id(1) * RB
        e, leader, first, dup, index = _routes(ids, pair, T, K, BT, BK)
        ITERS = RB * (F // 8 // BW)
        if leader:
            words, scales = wd + e * L * (F // 8), sd + e * L * (F // 32)
            routed = (index == first[:, None]) | dup
            p_sum = tl.sum(tl.where(routed, tl.load(weights + index, mask=routed, other=0.0), 0.0), 1)
            # A token that names the expert twice gets the summed weight on its first pair, zero on the rest.
            for rb in range(rb0, rb0 + RB):
                rows = rb * BR + tl.arange(0, BR)
                tl.store(partial + index.to(tl.int64)[:, :, None] * L + rows[None, None, :],
                         tl.zeros([BT, BK, BR], dtype=tl.float32), mask=dup[:, :, None] & (rows < L)[None, None, :])
            for t in range(T):
                tok = tl.arange(0, BT) == t
                p = tl.sum(tl.where(tok, first, 0))
                if p < (1 << 30):
                    weight = tl.sum(tl.where(tok, p_sum, 0.0))
                    rows, ok, c0 = _step(0, rb0, L, ITERS, F // 8, BR, BW)
                    w, s = _load_tile(words, scales, rows, ok, c0, F // 8, BW)
                    acc = tl.zeros([BR], dtype=tl.float32)
                    for it in range(ITERS):
                        rows, ok, c0 = _step(it, rb0, L, ITERS, F // 8, BR, BW)
                        n_rows, n_ok, n_c0 = _step(it + 1, rb0, L, ITERS, F // 8, BR, BW)
                        w_next, s_next = _load_tile(words, scales, n_rows, n_ok, n_c0, F // 8, BW)
                        acc += _tile_dot(w, s, h + p.to(tl.int64) * F, c0, BR, BW, USE_ASM)
                        if c0 + BW == F // 8:
                            tl.store(partial + p.to(tl.int64) * L + rows, weight * acc, mask=ok)
                            acc = tl.zeros([BR], dtype=tl.float32)
                        w, s = w_next, s_next

    @triton.jit
    def _sum_pairs_kernel(partial, out, K, L, BK: tl.constexpr, BL: tl.constexpr):
        t = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BL + tl.arange(0, BL)
        slot = tl.arange(0, BK)
        rows = tl.load(partial + (t * K + slot[:, None]) * L + cols[None, :],
                       mask=(slot[:, None] < K) & (cols[None, :] < L), other=0.0)
        tl.store(out + t * L + cols, tl.sum(rows, 0).to(out.dtype.element_ty), mask=cols < L)


def _words(packed: torch.Tensor) -> torch.Tensor:
    """The packed bytes as int32 words (8 codes each); a view, no copy."""
    return packed.contiguous().view(torch.int32)


def latent_moe_decode(
    x: torch.Tensor, expert_ids: torch.Tensor, expert_weights: torch.Tensor,
    gate_up_packed: torch.Tensor, gate_up_scales: torch.Tensor, down_packed: torch.Tensor,
    down_scales: torch.Tensor, beta1: float = 4.0, beta2: float = 25.0, block_rows: int = 16,
    block_cols: int = 1024, num_warps: int = 4, row_blocks: int = 2,
) -> torch.Tensor:
    """u = sum_j p_j E_{id_j}(x) per token (eq.11's routed sum, in the latent width l).

    x [T, l]; expert_ids, expert_weights [T, k]; gate_up_* for W_gate;W_up stacked [E, 2F, l] and down_*
    for W_down [E, l, F], both MXFP4-packed. Returns u [T, l] in x's dtype. `block_cols` columns (a
    multiple of 32) are streamed per step and row; a program walks `row_blocks` blocks of `block_rows` rows.
    """
    T, L = x.shape
    E, two_f, half_l = gate_up_packed.shape
    F = two_f // 2
    K = expert_ids.shape[1]
    require(x.is_contiguous(), "x must be contiguous")
    require(half_l * 2 == L, f"gate_up_packed must be [E, 2F, {L // 2}], got {tuple(gate_up_packed.shape)}")
    require(gate_up_scales.shape == (E, two_f, L // 32), f"gate_up_scales must be [{E}, {two_f}, {L // 32}]")
    require(down_packed.shape == (E, L, F // 2), f"down_packed must be [{E}, {L}, {F // 2}], got "
            f"{tuple(down_packed.shape)}")
    require(down_scales.shape == (E, L, F // 32), f"down_scales must be [{E}, {L}, {F // 32}]")
    require(expert_weights.shape == (T, K), f"expert_weights must be [{T}, {K}] like expert_ids")
    require(gate_up_packed.dtype == torch.uint8 and down_packed.dtype == torch.uint8, "packed weights are uint8")
    bc_up, bc_down = min(block_cols, L), min(block_cols, F)  # columns streamed per step: l, then F
    require(block_cols >= 32 and block_cols == next_pow2(block_cols) and L % bc_up == 0 and F % bc_down == 0,
            f"l={L} and F={F} must be multiples of a power-of-two column block >= 32")
    ids = expert_ids.contiguous()
    routing = {"BT": next_pow2(T), "BK": next_pow2(K), "USE_ASM": x.is_cuda, "num_warps": num_warps}
    h = torch.empty(T * K, F, dtype=torch.float32, device=x.device)
    _gate_up_kernel[(T * K, triton.cdiv(F, block_rows * row_blocks))](
        x, ids, _words(gate_up_packed), gate_up_scales, h, T, K, F, beta1, beta2, L=L, BR=block_rows, BW=bc_up // 8,
        RB=row_blocks, **routing,
    )
    partial = torch.empty(T * K, L, dtype=torch.float32, device=x.device)
    _down_kernel[(T * K, triton.cdiv(L, block_rows * row_blocks))](
        h, ids, expert_weights.contiguous(), _words(down_packed), down_scales, partial, T, K, F=F, L=L,
        BR=block_rows, BW=bc_down // 8, RB=row_blocks, **routing,
    )
    out = torch.empty(T, L, dtype=x.dtype, device=x.device)
    _sum_pairs_kernel[(T, triton.cdiv(L, 1024))](partial, out, K, L, BK=next_pow2(K), BL=1024)
    return out
