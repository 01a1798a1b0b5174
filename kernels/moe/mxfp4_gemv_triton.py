"""Latent-MoE decode without tensor cores, for experts that few tokens share (T <= 4): CUDA-core FMAs.

The tensor-core path (kernels.moe.latent_moe_decode_triton) pads an expert's tokens to 16 MMA rows; with
1-4 tokens that padding is most of the product, and its 16-row activation fragments and wide decoded tiles
hold enough registers that few programs fit an SM, so at T = 1 a program's loop latency, not the memory,
sets the time (docs/kernels.md, history 25, 27). Here each thread decodes whole 32-column scale groups of
a few rows (`prepare`'s words: 4 per group, one multiplier) into float32 and multiplies them with the
tokens' activations by FMA; the weights are read once per step for every token of the expert. A program
owns `rows` weight rows of one expert; its reduction is cut into `splits` contiguous ranges walked side by
side (one step reads `splits` groups-of-`cols` per row), so that one expert gives many threads at T = 1,
and the range sums are added once at the end. Accumulation is float32; h is stored as float32 (no bf16
parts: it keeps x's precision for bf16, fp16 and float32 x).

Kernel 1: gate and up rows -> SiTU-GLU -> h [T*k, F] float32. Kernel 2: down rows x the router weight ->
[1, T*k, l] (the rows of the first pair that names the expert), summed per token by the tensor-core
path's third kernel.

Opt-in (both tiles GemvTile): measured slower than the tensor cores on the H200 at T = 1 / 2 / 4 (history
27: 53.1 / 96.9 / 437 us against 41.0 / 56.6 / 98.7). Offline (Triton 3.6, ptxas) the loop costs ~40 SASS
instructions per weight word at one token (decode 12, float32 widening 8, FMAs 8 per token, activation
widening and shared-memory traffic the rest) against ~19 on the tensor cores, and ~90 at four tokens.
"""

from __future__ import annotations

import torch

from kernels._triton import next_pow2, tl, triton
from kernels.moe.mxfp4_tile_triton import block_words
from kernels.moe.tiles import GemvTile

if triton is not None:
    from kernels.moe.expert_slots_triton import expert_tokens, slots
    from kernels.moe.mxfp4_tile_triton import (
        bf16x2_multipliers,
        block_col_part,
        block_row_part,
        decode_word_f32,
        unshift,
    )
    from kernels.moe.situ_glu_triton import situ_glu_values

    @triton.jit
    def gemv_weights(words, mults, rows, row_ok, g0, SPAN: tl.constexpr, S: tl.constexpr, G: tl.constexpr,
                     WORDS: tl.constexpr, CW: tl.constexpr, USE_ASM: tl.constexpr):
        """float32 [S, R, G, 32]: weights x 2^-SHIFT of `rows`, for range s the groups s SPAN + g0 .. + G
        (32 columns each); inside a group word-major, and inside a word position p holds column
        p // 2 + 4 (p % 2) (`gemv_activations` matches it)."""
        R: tl.constexpr = rows.shape[0]
        groups = (tl.arange(0, S) * SPAN)[:, None] + g0 + tl.arange(0, G)[None, :]  # [S, G]
        # [S, G, 4] word offsets in a row: each group's 4 words lie together in a block (16 aligned bytes)
        w_cols = block_col_part(groups[:, :, None] * 4 + tl.arange(0, 4)[None, None, :], CW)
        w_cols = tl.max_contiguous(tl.multiple_of(w_cols, [1, 1, 4]), [1, 1, 4])
        w = tl.load(words + block_row_part(rows, WORDS, CW)[None, :, None, None] + w_cols[:, None, :, :],
                    mask=row_ok[None, :, None, None], other=0).to(tl.uint32, bitcast=True)
        f = tl.load(mults + block_row_part(rows, WORDS // 4, CW // 4)[None, :, None]
                    + block_col_part(groups, CW // 4)[:, None, :], mask=row_ok[None, :, None], other=0)
        m = tl.broadcast_to(bf16x2_multipliers(f)[:, :, :, None], (S, R, G, 4))
        e0, e1, e2, e3, e4, e5, e6, e7 = decode_word_f32(w, m, USE_ASM)
        low = tl.join(tl.join(e0, e2), tl.join(e1, e3))
        high = tl.join(tl.join(e4, e6), tl.join(e5, e7))
        return tl.reshape(tl.join(low, high), (S, R, G, 32))

    @triton.jit
    def gemv_activations(row, g0, SPAN: tl.constexpr, S: tl.constexpr, G: tl.constexpr):
        """float32 [S, G, 32]: one slot's activations (`row` points at them) in `gemv_weights`' column order
        (loaded contiguously, permuted inside each word in registers). Not masked: an empty slot reads a
        valid row (its pair is 0) and its results are not stored, so the loads stay 16-byte vectors."""
        cols = ((tl.arange(0, S) * SPAN)[:, None, None] + g0 + tl.arange(0, G)[None, :, None]) * 32 \
            + tl.arange(0, 32)[None, None, :]
        a = tl.load(row + cols).to(tl.float32)
        return tl.reshape(tl.permute(tl.reshape(a, (S, G, 4, 2, 4)), (0, 1, 2, 4, 3)), (S, G, 32))

    @triton.jit
    def _gemv(w, act, acc):
        """acc [S, R, G] + the products of w [S, R, G, 32] and one slot's act [S, G, 32], summed per group
        inside each thread. One slot at a time: w keeps the layout it was decoded in (a token axis in front of
        it would not, and the products would move between threads)."""
        return acc + tl.sum(w * act[:, None, :, :], 3)

    @triton.jit
    def _total(acc):
        """[S, R, G] -> [R]: the ranges' and groups' sums, in the true scale."""
        return unshift(tl.sum(tl.sum(acc, 2), 0))

    @triton.jit
    def _slot(pair, used, i: tl.constexpr):
        """Slot i's first pair and 1 where it holds a token, else 0 (int32 scalars: masks are built from
        them as `flag + offsets * 0 > 0`, which the interpreter takes where a broadcast boolean scalar
        fails)."""
        here = tl.arange(0, pair.shape[0]) == i
        return tl.sum(tl.where(here, pair, 0)), tl.sum(tl.where(here, used.to(tl.int32), 0))

    @triton.jit
    def _acts(x, pair, i: tl.constexpr, K, L: tl.constexpr, g0, SPAN: tl.constexpr, S: tl.constexpr,
              G: tl.constexpr):
        p = tl.sum(tl.where(tl.arange(0, pair.shape[0]) == i, pair, 0))
        return gemv_activations(x + (p // K) * L, g0, SPAN, S, G)

    @triton.jit
    def _store_h(h, pair, used, i: tl.constexpr, rows, ok, F, g, u, beta1, beta2):
        p, here = _slot(pair, used, i)
        tl.store(h + p * F + rows, situ_glu_values(_total(g), _total(u), beta1, beta2),
                 mask=ok & (here + rows * 0 > 0))

    @triton.jit(do_not_specialize=["T"])
    def gate_up_gemv_kernel(x, ids, wgu, mgu, h, T, K, F, beta1, beta2, L: tl.constexpr, BR: tl.constexpr,
                            G: tl.constexpr, S: tl.constexpr, TP: tl.constexpr, BK: tl.constexpr,
                            BT: tl.constexpr, CW: tl.constexpr, STAGES: tl.constexpr, USE_ASM: tl.constexpr):
        """Up to 4 token slots per pass (BT = 1, 2 or 4), each with its own gate and up accumulators."""
        e, leader, first, _match, _index = expert_tokens(ids, tl.program_id(0), T, K, TP, BK)
        if leader:
            rows = tl.program_id(1) * BR + tl.arange(0, BR)
            ok = rows < F
            words, mults = wgu + e * (2 * F) * (L // 8), mgu + e * (2 * F) * (L // 32)
            SPAN: tl.constexpr = L // 32 // S  # groups per range
            for n0 in range(0, tl.sum((first < (1 << 30)).to(tl.int32)), BT):
                _hit, pair, used = slots(first, n0, BT)
                g0_acc = tl.zeros([S, BR, G], dtype=tl.float32)
                g1_acc, g2_acc, g3_acc, u0_acc, u1_acc, u2_acc, u3_acc = g0_acc, g0_acc, g0_acc, g0_acc, g0_acc, \
                    g0_acc, g0_acc
                for g0 in tl.range(0, SPAN, G, num_stages=STAGES):
                    wg = gemv_weights(words, mults, rows, ok, g0, SPAN, S, G, L // 8, CW, USE_ASM)
                    wu = gemv_weights(words, mults, rows + F, ok, g0, SPAN, S, G, L // 8, CW, USE_ASM)
                    xt = _acts(x, pair, 0, K, L, g0, SPAN, S, G)
                    g0_acc, u0_acc = _gemv(wg, xt, g0_acc), _gemv(wu, xt, u0_acc)
                    if BT > 1:
                        xt = _acts(x, pair, 1, K, L, g0, SPAN, S, G)
                        g1_acc, u1_acc = _gemv(wg, xt, g1_acc), _gemv(wu, xt, u1_acc)
                    if BT > 2:
                        xt = _acts(x, pair, 2, K, L, g0, SPAN, S, G)
                        g2_acc, u2_acc = _gemv(wg, xt, g2_acc), _gemv(wu, xt, u2_acc)
                        xt = _acts(x, pair, 3, K, L, g0, SPAN, S, G)
                        g3_acc, u3_acc = _gemv(wg, xt, g3_acc), _gemv(wu, xt, u3_acc)
                _store_h(h, pair, used, 0, rows, ok, F, g0_acc, u0_acc, beta1, beta2)
                if BT > 1:
                    _store_h(h, pair, used, 1, rows, ok, F, g1_acc, u1_acc, beta1, beta2)
                if BT > 2:
                    _store_h(h, pair, used, 2, rows, ok, F, g2_acc, u2_acc, beta1, beta2)
                    _store_h(h, pair, used, 3, rows, ok, F, g3_acc, u3_acc, beta1, beta2)

    @triton.jit
    def _store_rows(partial, pair, used, hit, p_tok, i: tl.constexpr, rows, ok, L, acc):
        """Slot i's down rows times its token's router weight into `partial`."""
        p, here = _slot(pair, used, i)
        weight = tl.sum(tl.where(hit, p_tok[None, :], 0.0), 1)
        w_i = tl.sum(tl.where(tl.arange(0, pair.shape[0]) == i, weight, 0.0))
        tl.store(partial + p * L + rows, _total(acc) * w_i, mask=ok & (here + rows * 0 > 0))

    @triton.jit(do_not_specialize=["T"])
    def down_gemv_kernel(h, ids, weights, wd, md, partial, T, K, L, F: tl.constexpr, BR: tl.constexpr,
                         G: tl.constexpr, S: tl.constexpr, TP: tl.constexpr, BK: tl.constexpr, BT: tl.constexpr,
                         CW: tl.constexpr, STAGES: tl.constexpr, USE_ASM: tl.constexpr):
        e, leader, first, match, index = expert_tokens(ids, tl.program_id(0), T, K, TP, BK)
        if leader:
            rows = tl.program_id(1) * BR + tl.arange(0, BR)
            ok = rows < L
            words, mults = wd + e * L * (F // 8), md + e * L * (F // 32)
            SPAN: tl.constexpr = F // 32 // S
            # A token that names the expert in several slots gets the sum of their router weights.
            p_tok = tl.sum(tl.load(weights + index, mask=match, other=0.0), 1)
            for n0 in range(0, tl.sum((first < (1 << 30)).to(tl.int32)), BT):
                hit, pair, used = slots(first, n0, BT)
                acc0 = tl.zeros([S, BR, G], dtype=tl.float32)
                acc1, acc2, acc3 = acc0, acc0, acc0
                for g0 in tl.range(0, SPAN, G, num_stages=STAGES):
                    w = gemv_weights(words, mults, rows, ok, g0, SPAN, S, G, F // 8, CW, USE_ASM)
                    acc0 = _gemv(w, _acts(h, pair, 0, 1, F, g0, SPAN, S, G), acc0)
                    if BT > 1:
                        acc1 = _gemv(w, _acts(h, pair, 1, 1, F, g0, SPAN, S, G), acc1)
                    if BT > 2:
                        acc2 = _gemv(w, _acts(h, pair, 2, 1, F, g0, SPAN, S, G), acc2)
                        acc3 = _gemv(w, _acts(h, pair, 3, 1, F, g0, SPAN, S, G), acc3)
                _store_rows(partial, pair, used, hit, p_tok, 0, rows, ok, L, acc0)
                if BT > 1:
                    _store_rows(partial, pair, used, hit, p_tok, 1, rows, ok, L, acc1)
                if BT > 2:
                    _store_rows(partial, pair, used, hit, p_tok, 2, rows, ok, L, acc2)
                    _store_rows(partial, pair, used, hit, p_tok, 3, rows, ok, L, acc3)

def gemv_partial(x: torch.Tensor, ids: torch.Tensor, expert_weights: torch.Tensor, experts: tuple,
                 beta1: float, beta2: float, gate_up: GemvTile, down: GemvTile) -> torch.Tensor:
    """[1, T*k, l] float32: per (token, expert) pair that first names the expert, its router-weighted down
    rows (the tensor-core path's `partial` with one split). `experts`: a PreparedExperts; checked by the
    caller (kernels.moe.latent_moe_decode_triton.latent_moe_decode_prepared)."""
    T, L = x.shape
    K = ids.shape[1]
    gu_words, gu_mults, d_words, d_mults, blocked = experts
    F = gu_words.shape[1] // 2
    gu_groups, d_groups = gate_up.groups(L), down.groups(F)
    common = {"TP": max(16, next_pow2(T)), "BK": next_pow2(K), "USE_ASM": x.is_cuda}
    h = torch.empty(T * K, F, dtype=torch.float32, device=x.device)
    gate_up_gemv_kernel[(T * K, triton.cdiv(F, gate_up.rows))](
        x, ids, gu_words, gu_mults, h, T, K, F, beta1, beta2, L=L, BR=gate_up.rows, G=gu_groups,
        S=gate_up.splits, BT=min(gate_up.tokens, next_pow2(T)), CW=block_words(L // 8) if blocked else L // 8,
        STAGES=gate_up.stages, **common, **gate_up.launch_options())
    partial = torch.empty(1, T * K, L, dtype=torch.float32, device=x.device)
    down_gemv_kernel[(T * K, triton.cdiv(L, down.rows))](
        h, ids, expert_weights, d_words, d_mults, partial, T, K, L, F=F, BR=down.rows, G=d_groups, S=down.splits,
        BT=min(down.tokens, next_pow2(T)), CW=block_words(F // 8) if blocked else F // 8, STAGES=down.stages,
        **common, **down.launch_options())
    return partial
