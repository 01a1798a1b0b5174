"""KDA prefill, pass 2 of 4: the UT transform of one chunk of C = 64 tokens of one head.

From the prologue's outputs (prefill_prep_triton.py: normalised q, k, the conv output v, the in-chunk
cumulative gate G, sigmoid(beta)) it computes (K3 report eq.4, the WY form of Kimi Linear; notation of
k3core/ops/kda_chunk.py):
    Akk[r, i] = sum_c k_r k_i exp(G_r - G_i)  (i < r),   T = (I + diag(beta) Akk)^-1
    w = -T diag(beta) (K * exp(G)),  u = T diag(beta) V,  Aqk = scale * sum_c q_r k_i exp(G_r - G_i) (i <= r)
    qg = scale * Q * exp(G),  kg = K * exp(G_C - G),  gC = exp(G_C)
which is all the recurrence and the output pass (prefill_recurrence_triton.py) need. w leaves negated (the sign rides
on beta) so that the recurrence forms v_new = u - (T beta K e^G) S as one dot accumulating onto u: no
separate float32 tile of w S (sm_90a: the fused recurrence's spills 248 -> 80 B, none left at 64 columns).
The gate is bounded (g >= lower_bound = -5), so within a sub-block of 16 tokens G moves by at most 80 and
exp(+-80) fits float32: the decay ratios exp(G_r - G_i) are split at the end of the key's sub-block (every
factor <= 1 off the diagonal block, <= e^80 on it), which lets tensor-core dots in the input dtype form
them. The key dimension is walked in BK-column blocks so that only [C, BK] tiles are live besides the
[C, C] matrices.
"""

from __future__ import annotations

from kernels._triton import tl, triton

CHUNK = 64
SUB = 16  # sub-block of the decay split: |lower_bound| * SUB must stay below ~88 (float32 exp range)

if triton is not None:

    @triton.jit
    def _chunk_head(H):
        """(chunk int64, head) of a per-(chunk, head) program on a 1-D grid (chunks * H), chunk-major: the
        programs running at once cover all heads of a few chunks, one contiguous stretch of the token-major
        tensors (head-major, they read one head's rows of many chunks: 2 * D bytes every 2 * H * D). H200,
        same run: UT pass 0.87 -> 0.84 ms (B=1, T=32K, H=16), 1.72 -> 1.66 (B=8, T=4K, H=32); output pass
        0.26 -> 0.25, 1.01 -> 0.96 (T=128K). The prep pass stays head-major: chunk-major it measured slower
        (0.44 -> 0.53 ms at 32K, 0.89 -> 1.05 at B=8)."""
        pid = tl.program_id(0)
        return (pid // H).to(tl.int64), pid % H

    @triton.jit
    def _diagonal_block_inverses(diag, C: tl.constexpr, BC: tl.constexpr, DOT: tl.constexpr):
        """(I + M_bb)^-1 of the C / BC diagonal BC x BC blocks `diag` [C / BC, BC, BC] of the strictly
        lower-triangular M [C, C], in float32, by block doubling with batched dots:
        with X_s the inverse of the s x s diagonal blocks and L_s the entries of M between the two s-halves
        of each 2s-block, X_2s = X_s - X_s L_s X_s (exact, since (L_s X_s)^2 = 0); X_2 = I - L_1 needs no
        dot, so 6 small dots, at input precision DOT. It replaced forward substitution row by row (two cross-thread reductions per
        row, a serial chain: 119 barrier and 240 shuffle instructions vs 17 and 0 in sm_90a SASS; the UT
        pass 1.10 -> 0.98 ms at B=1, T=32K, H=16 on the H200)."""
        NB: tl.constexpr = C // BC
        r3 = tl.arange(0, BC)[None, :, None]
        j3 = tl.arange(0, BC)[None, None, :]
        X = tl.where(r3 == j3, 1.0, 0.0) + tl.zeros([NB, BC, BC], dtype=tl.float32)
        X -= tl.where((r3 == j3 + 1) & (r3 % 2 == 1), diag, 0.0)  # X_1 = I: X_2 = I - L_1, no dots
        for level in tl.static_range(1, BC.bit_length() - 1):
            s = 1 << level
            L = tl.where((r3 // (2 * s) == j3 // (2 * s)) & (r3 // s > j3 // s), diag, 0.0)
            X -= tl.dot(tl.dot(X, L, input_precision=DOT), X, input_precision=DOT)
        return X

    @triton.jit
    def _unit_lower_inverse(M, diag, rows, C: tl.constexpr, BC: tl.constexpr, DOT: tl.constexpr):
        """(I + M)^-1 for the strictly lower-triangular M [C, C] (float32) with its diagonal blocks `diag`
        [C / BC, BC, BC]: the diagonal blocks' inverses D^-1, then the block off-diagonal terms by the
        nilpotent series with dots: (D + L)^-1 = (I - N + N^2 - N^3) D^-1, N = D^-1 L, since N^4 = 0 for
        C / BC = 4 blocks. The diagonal blocks' dots take the pass's precision DOT too (TF32 for 16-bit
        activations): in IEEE float32 they ran on the FMA pipe (sm_90a, 4 warps: 768 FFMA per thread; the
        inverse's straight-line code 2516 vs 1690 instructions per warp, of ~7.9 K for the pass); H200, same
        run: UT pass 0.94 -> 0.87 ms at B=1, T=32K, H=16, 1.87 -> 1.73 at B=8, T=4K, H=32, errors unchanged to
        3 digits (y 3.8-3.9e-3)."""
        NB: tl.constexpr = C // BC
        tl.static_assert(NB == 4, "the series below stops at N^3: exactly 4 sub-blocks per chunk")
        X = _diagonal_block_inverses(diag, C, BC, DOT)
        same = tl.arange(0, NB)[:, None, None, None] == tl.arange(0, NB)[None, None, :, None]
        d_inv = tl.reshape(tl.where(same, X[:, :, None, :], 0.0), [C, C])
        cols = tl.arange(0, C)
        lower = tl.where(rows[:, None] // BC > cols[None, :] // BC, M, 0.0)
        N = tl.dot(d_inv, lower, input_precision=DOT)
        eye = tl.where(rows[:, None] == cols[None, :], 1.0, 0.0)
        # Horner form: three [C, C] tiles live, not four
        series = eye - tl.dot(N, eye - tl.dot(N, eye - N, input_precision=DOT), input_precision=DOT)
        return tl.dot(series, d_inv, input_precision=DOT)

    @triton.jit
    def _flat_gate(g, rel, io_mask, last, HD, cols):
        """G of the channels `cols` [C, BK] at row offsets `rel`; rows past the sequence end repeat the last
        valid row, so that G stays flat there (their k and q are zero, and no decay factor can overflow)."""
        g_last = tl.load(g + last * HD + cols)
        return tl.where(io_mask, tl.load(g + rel, mask=io_mask, other=0.0), g_last[None, :]), g_last

    @triton.jit
    def _a_parts(k, g, G, kc, qc, rows, cols, last, n_valid, HD, blk: tl.constexpr, BC: tl.constexpr,
                 dt: tl.constexpr, DOT: tl.constexpr):
        """Key sub-block blk's share of Akk and Aqk [C, BC] from the key columns `cols` (G float32; kc, qc: their
        [C, len(cols)] tiles in dt, the dots' operand dtype, which the row scaling takes too). The decay ratio
        is split at the end of the key sub-block: factors <= 1 off the diagonal block, <= 2^116 on it
        (bfloat16 holds that range); rows before the block are causally masked (factor 0)."""
        sub = tl.arange(0, BC)
        ref = tl.load(g + tl.minimum(blk * BC + BC - 1, last) * HD + cols)
        row_decay = tl.math.exp2(tl.where(rows[:, None] >= blk * BC, G - ref[None, :], -1e30))
        key_rel = (blk * BC + sub)[:, None] * HD + cols[None, :]
        key_ok = (blk * BC + sub < n_valid)[:, None]
        k_key = tl.load(k + key_rel, mask=key_ok, other=0.0).to(tl.float32)
        g_key = tl.load(g + key_rel, mask=key_ok, other=0.0)
        k_col = tl.trans((k_key * tl.math.exp2(ref[None, :] - g_key)).to(dt))
        row_decay = row_decay.to(dt)
        return (tl.dot(kc * row_decay, k_col, input_precision=DOT),
                tl.dot(qc * row_decay, k_col, input_precision=DOT))

    @triton.jit
    def _store_aqk_block(aqk_st, aq, c0, rows, scale, io_mask, BC: tl.constexpr):
        """Key columns c0 .. c0+BC-1 of scale * Aqk (i <= r) to the output rows."""
        kcols = c0 + tl.arange(0, BC)
        aq = tl.where(kcols[None, :] <= rows[:, None], aq * scale, 0.0)
        tl.store(aqk_st + kcols[None, :], aq.to(aqk_st.dtype.element_ty), mask=io_mask)

    @triton.jit
    def _akk_in_registers(ak0, ak1, ak2, ak3, bt, rows, C: tl.constexpr, BC: tl.constexpr):
        """beta_r Akk [C, C] (i < r) and its diagonal blocks [C / BC, BC, BC] from the four [C, BC] key
        sub-block accumulators, assembled in registers (Triton converts the layouts through shared memory).
        It replaced a round trip through a per-program float32 scratch tile in global memory (16 KB stored, a
        barrier, loaded back: 268 MB each way at B=8, T=4K, H=32): sm_90a 3568 -> 3472 instructions, 62 -> 44
        barriers; H200, same run: UT pass 0.81 -> 0.69 ms at B=1, T=32K, H=16, 1.59 -> 1.38 at B=8, T=4K,
        H=32, errors unchanged (y 3.9-4.0e-3)."""
        NB: tl.constexpr = C // BC
        parts = tl.join(tl.join(ak0, ak1), tl.join(ak2, ak3))  # [C, BC, 2, 2]: [r, c, i, o] = ak_(2o+i)[r, c]
        M = tl.reshape(tl.permute(parts, (0, 3, 2, 1)), (C, C))
        cols = tl.arange(0, C)
        M = tl.where(cols[None, :] < rows[:, None], M * bt[:, None], 0.0)
        same = tl.arange(0, NB)[:, None, None, None] == tl.arange(0, NB)[None, None, :, None]
        diag = tl.sum(tl.where(same, tl.reshape(M, (NB, BC, NB, BC)), 0.0), axis=2)
        return M, diag

    @triton.jit
    def _kda_chunk_ut_kernel(
        q, k, v, g, beta, cu_seqlens, chunk_seq, chunk_start,
        w_out, u_out, qg_out, kg_out, aqk_out, gc_out, scale,
        H, D: tl.constexpr, C: tl.constexpr, BC: tl.constexpr, BK: tl.constexpr, F32_DOTS: tl.constexpr,
        DOT: tl.constexpr,
    ):
        """Grid (chunks * H,), chunk-major (see _chunk_head). Token-major [T_total, H, *] in and out; g float32
        in log2 units (G * log2(e): the decay factors are bare exp2, one MUFU op each, where exp costs a
        multiply and a range fix-up more), beta [T_total, H] float32 (already through the sigmoid); gc_out
        [chunks, H, D]. F32_DOTS: float32 dot operands instead of the input dtype. DOT: the float32 dots'
        input_precision ("tf32" or "ieee", see prefill_triton.dot_precision). The Akk / Aqk loop scales its
        key and query rows in the dots' dtype (bf16x2 multiplies, the decay factor rounded first) rather than
        in float32 with the product rounded once: sm_90a 759 -> 606 instructions per key block, no spills
        under the 168 cap; H200, same run: UT pass 0.84 -> 0.81 ms at B=1, T=32K, H=16, 1.66 -> 1.61 at B=8,
        T=4K, H=32; y's error vs float64 3.8 -> 4.0e-3 at D=128 (CPU emulation at nano's D=32: 1.7 -> 2.7e-2
        max-relative)."""
        ci, h = _chunk_head(H)
        start = tl.load(chunk_start + ci).to(tl.int64)
        n_valid = (tl.load(cu_seqlens + tl.load(chunk_seq + ci) + 1) - start).to(tl.int32)
        # Every pointer is moved to this chunk's first row once; tiles then use 32-bit offsets (64-bit ones
        # for each [C, BK] tile cost registers that the dots need).
        base = (start * H + h) * D
        q, k, v, g = q + base, k + base, v + base, g + base
        w_out, u_out, qg_out, kg_out = w_out + base, u_out + base, qg_out + base, kg_out + base
        aqk_out += (start * H + h) * C
        beta += start * H + h
        gc_out += (ci * H + h) * D
        HD = H * D
        rows = tl.arange(0, C)
        valid = rows < n_valid
        io_mask = valid[:, None]
        last = tl.minimum(n_valid, C) - 1
        dt = tl.float32 if F32_DOTS else q.dtype.element_ty
        NB: tl.constexpr = C // BC
        aqk_st = aqk_out + rows[:, None] * (H * C)
        # Akk / Aqk by key sub-block: four [C, BC] column blocks each (the causal zeros are not computed). The
        # row tiles are loaded once per key-column block, so eight accumulators are live (block by block
        # instead, two accumulators and 4 programs per SM under 128 registers: UT pass 1.08 vs 0.97 ms).
        ak0 = tl.zeros([C, BC], dtype=tl.float32)
        ak1, ak2, ak3, aq0, aq1, aq2, aq3 = ak0, ak0, ak0, ak0, ak0, ak0, ak0
        for kb in range(0, D // BK):
            cols = kb * BK + tl.arange(0, BK)
            rel = rows[:, None] * HD + cols[None, :]
            G, _ = _flat_gate(g, rel, io_mask, last, HD, cols)
            kc = tl.load(k + rel, mask=io_mask, other=0.0).to(dt)
            qc = tl.load(q + rel, mask=io_mask, other=0.0).to(dt)
            for blk in tl.static_range(NB):
                part_k, part_q = _a_parts(k, g, G, kc, qc, rows, cols, last, n_valid, HD, blk, BC, dt, DOT)
                if blk == 0:
                    ak0 += part_k
                    aq0 += part_q
                elif blk == 1:
                    ak1 += part_k
                    aq1 += part_q
                elif blk == 2:
                    ak2 += part_k
                    aq2 += part_q
                else:
                    ak3 += part_k
                    aq3 += part_q
        # beta loaded after the loop and again after the inverse: not live across them (sm_90a under the
        # 168-register cap, with the scratch tile: 40 instead of 64 B of spills; since Akk is assembled in
        # registers the kernel spills nothing)
        bt = tl.load(beta + rows * H, mask=valid, other=0.0)
        _store_aqk_block(aqk_st, aq0, 0, rows, scale, io_mask, BC)
        _store_aqk_block(aqk_st, aq1, BC, rows, scale, io_mask, BC)
        _store_aqk_block(aqk_st, aq2, 2 * BC, rows, scale, io_mask, BC)
        _store_aqk_block(aqk_st, aq3, 3 * BC, rows, scale, io_mask, BC)
        M, diag = _akk_in_registers(ak0, ak1, ak2, ak3, bt, rows, C, BC)
        T = _unit_lower_inverse(M, diag, rows, C, BC, DOT).to(dt)
        bt = tl.load(beta + rows * H, mask=valid, other=0.0)
        for kb in range(0, D // BK):
            cols = kb * BK + tl.arange(0, BK)
            rel = rows[:, None] * HD + cols[None, :]
            G, g_end = _flat_gate(g, rel, io_mask, last, HD, cols)
            kc = tl.load(k + rel, mask=io_mask, other=0.0).to(tl.float32)
            decay = tl.math.exp2(G)
            w_blk = tl.dot(T, (kc * decay * -bt[:, None]).to(dt), input_precision=DOT)
            tl.store(w_out + rel, w_blk.to(w_out.dtype.element_ty), mask=io_mask)
            kg_blk = kc * tl.math.exp2(g_end[None, :] - G)
            tl.store(kg_out + rel, kg_blk.to(kg_out.dtype.element_ty), mask=io_mask)
            tl.store(gc_out + cols, tl.math.exp2(g_end))
            qc = tl.load(q + rel, mask=io_mask, other=0.0).to(tl.float32)
            qg_blk = (qc * decay * scale).to(qg_out.dtype.element_ty)
            tl.store(qg_out + rel, qg_blk, mask=io_mask)
        for vb in range(0, D // BK):
            cols = vb * BK + tl.arange(0, BK)
            rel = rows[:, None] * HD + cols[None, :]
            vc = tl.load(v + rel, mask=io_mask, other=0.0).to(tl.float32)
            u_blk = tl.dot(T, (vc * bt[:, None]).to(dt), input_precision=DOT).to(u_out.dtype.element_ty)
            tl.store(u_out + rel, u_blk, mask=io_mask)
