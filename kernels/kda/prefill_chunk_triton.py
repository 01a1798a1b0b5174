"""KDA prefill, passes 2 and 3 of 5: the UT transform of one chunk of C = 64 tokens of one head.

From the prologue's outputs (prefill_prep_triton.py: normalised q, k, the conv output v, the in-chunk
cumulative gate G, sigmoid(beta)) it computes (K3 report eq.4, the WY form of Kimi Linear; notation of
k3core/ops/kda_chunk.py):
    Akk[r, i] = sum_c k_r k_i exp(G_r - G_i)  (i < r),   T = (I + diag(beta) Akk)^-1
    w = T diag(beta) (K * exp(G)),  u = T diag(beta) V,  Aqk = scale * sum_c q_r k_i exp(G_r - G_i) (i <= r)
    qg = scale * Q * exp(G),  kg = K * exp(G_C - G),  gC = exp(G_C)
which is all the recurrence and the output pass (prefill_triton.py) need. Two kernels: Akk / Aqk one key
sub-block per program (4x the programs of a whole chunk: the chain of dependent loads and dots of one
program is what bounded the one-kernel form, 1.34 ms at B=1, T=32K, H=16 on the H200), then T, w, u,
qg, kg per chunk.
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
    def _substitution_step(m, X, c0, i: tl.constexpr, r, C: tl.constexpr):
        """Row i of (I + M_bb)^-1 for the diagonal block at rows/columns c0.. of m, from rows 0..i-1 of X."""
        a = tl.load(m + (c0 + i) * C + c0 + r, mask=r < i, other=0.0)
        x = tl.where(r == i, 1.0, 0.0) - tl.sum(a[:, None] * X, axis=0)
        return tl.where(r[:, None] == i, x[None, :], X)

    @triton.jit
    def _unit_lower_inverse(m, rows, C: tl.constexpr, BC: tl.constexpr):
        """(I + M)^-1 for the strictly lower-triangular float32 M [C, C] at m (row-major; the program's own
        copy: its diagonal blocks are overwritten). Forward substitution inside the four BC x BC diagonal
        blocks (float32, rows read back from memory, the four blocks interleaved), then the off-diagonal
        blocks by the nilpotent series with dots: (D + L)^-1 = (I - N + N^2 - N^3) D^-1, N = D^-1 L, since
        N^4 = 0 for four blocks. Plain 2-D tiles: the reshaped 3-D/4-D form faulted at 8 warps (Triton 3.6)."""
        tl.static_assert(C == 4 * BC, "the series below stops at N^3: exactly 4 sub-blocks per chunk")
        r = tl.arange(0, BC)
        X0 = tl.where(r[:, None] == r[None, :], 1.0, 0.0)
        X1, X2, X3 = X0, X0, X0
        for i in tl.static_range(1, BC):
            X0 = _substitution_step(m, X0, 0, i, r, C)
            X1 = _substitution_step(m, X1, BC, i, r, C)
            X2 = _substitution_step(m, X2, 2 * BC, i, r, C)
            X3 = _substitution_step(m, X3, 3 * BC, i, r, C)
        tl.debug_barrier()  # every thread has read the diagonal blocks before they are overwritten
        blk = r[:, None] * C + r[None, :]
        tl.store(m + blk, X0)
        tl.store(m + BC * (C + 1) + blk, X1)
        tl.store(m + 2 * BC * (C + 1) + blk, X2)
        tl.store(m + 3 * BC * (C + 1) + blk, X3)
        tl.debug_barrier()
        cols = tl.arange(0, C)
        M = tl.load(m + rows[:, None] * C + cols[None, :])
        d_inv = tl.where(rows[:, None] // BC == cols[None, :] // BC, M, 0.0)
        N = tl.dot(d_inv, tl.where(rows[:, None] // BC > cols[None, :] // BC, M, 0.0))
        N2 = tl.dot(N, N)
        N3 = tl.dot(N2, N)
        eye = tl.where(rows[:, None] == cols[None, :], 1.0, 0.0)
        return tl.dot(eye - N + N2 - N3, d_inv)

    @triton.jit
    def _flat_gate(g, rel, io_mask, last, HD, cols):
        """G of the channels `cols` [C, BK] at row offsets `rel`; rows past the sequence end repeat the last
        valid row, so that G stays flat there (their k and q are zero, and no decay factor can overflow)."""
        g_last = tl.load(g + last * HD + cols)
        return tl.where(io_mask, tl.load(g + rel, mask=io_mask, other=0.0), g_last[None, :]), g_last

    @triton.jit
    def _chunk_rows(cu_seqlens, chunk_seq, chunk_start, ci, h, H, D: tl.constexpr):
        """(first row, number of valid rows, element offset of row 0 of head h) of chunk ci."""
        start = tl.load(chunk_start + ci).to(tl.int64)
        n_valid = (tl.load(cu_seqlens + tl.load(chunk_seq + ci) + 1) - start).to(tl.int32)
        return start, n_valid, (start * H + h) * D

    @triton.jit
    def _kda_chunk_a_kernel(
        q, k, g, beta, cu_seqlens, chunk_seq, chunk_start, aqk_out, akk_out, scale,
        H, D: tl.constexpr, C: tl.constexpr, BC: tl.constexpr, BK: tl.constexpr, F32_DOTS: tl.constexpr,
    ):
        """Grid (chunks, H, C // BC): key sub-block j of Aqk (scaled, i <= r) to aqk_out [T_total, H, C] and
        of beta_r Akk (i < r) to akk_out [chunks, H, C, C] float32 (the next kernel's scratch). Pointers
        move to the chunk's row 0 once; tiles use 32-bit offsets (64-bit ones cost registers)."""
        ci = tl.program_id(0).to(tl.int64)
        h = tl.program_id(1)
        j = tl.program_id(2)
        start, n_valid, base = _chunk_rows(cu_seqlens, chunk_seq, chunk_start, ci, h, H, D)
        q, k, g = q + base, k + base, g + base
        HD = H * D
        rows = tl.arange(0, C)
        sub = tl.arange(0, BC)
        valid = rows < n_valid
        io_mask = valid[:, None]
        last = tl.minimum(n_valid, C) - 1
        dt = tl.float32 if F32_DOTS else q.dtype.element_ty
        key_ok = (j * BC + sub < n_valid)[:, None]
        ref_row = tl.minimum(j * BC + BC - 1, last)
        ak = tl.zeros([C, BC], dtype=tl.float32)
        aq = tl.zeros([C, BC], dtype=tl.float32)
        for kb in tl.static_range(D // BK):
            cols = kb * BK + tl.arange(0, BK)
            rel = rows[:, None] * HD + cols[None, :]
            G, _ = _flat_gate(g, rel, io_mask, last, HD, cols)
            # Split at the end of key sub-block j: factors <= 1 off the diagonal block, <= e^80 on it; rows
            # before the block are causally masked (factor 0 here).
            ref = tl.load(g + ref_row * HD + cols)
            row_decay = tl.exp(tl.where(rows[:, None] >= j * BC, G - ref[None, :], -1e30))
            key_rel = (j * BC + sub)[:, None] * HD + cols[None, :]
            k_key = tl.load(k + key_rel, mask=key_ok, other=0.0).to(tl.float32)
            g_key = tl.load(g + key_rel, mask=key_ok, other=0.0)
            k_col = tl.trans((k_key * tl.exp(ref[None, :] - g_key)).to(dt))
            kc = tl.load(k + rel, mask=io_mask, other=0.0).to(tl.float32)
            ak = tl.dot((kc * row_decay).to(dt), k_col, ak)
            qc = tl.load(q + rel, mask=io_mask, other=0.0).to(tl.float32)
            aq = tl.dot((qc * row_decay).to(dt), k_col, aq)
        kcols = j * BC + sub
        aq = tl.where(kcols[None, :] <= rows[:, None], aq * scale, 0.0)
        tl.store(aqk_out + (start * H + h) * C + rows[:, None] * (H * C) + kcols[None, :],
                 aq.to(aqk_out.dtype.element_ty), mask=io_mask)
        bt = tl.load(beta + (start + rows) * H + h, mask=valid, other=0.0)
        ak = tl.where(kcols[None, :] < rows[:, None], ak * bt[:, None], 0.0)
        tl.store(akk_out + (ci * H + h) * C * C + rows[:, None] * C + kcols[None, :], ak)

    @triton.jit
    def _kda_chunk_ut_kernel(
        q, k, v, g, beta, akk, cu_seqlens, chunk_seq, chunk_start, w_out, u_out, qg_out, kg_out, gc_out, scale,
        H, D: tl.constexpr, C: tl.constexpr, BC: tl.constexpr, BK: tl.constexpr, F32_DOTS: tl.constexpr,
    ):
        """Grid (chunks, H): T = (I + beta Akk)^-1 from akk [chunks, H, C, C], then w, u, qg, kg [T_total, H, D]
        and exp(G_C) to gc_out [chunks, H, D]."""
        ci = tl.program_id(0).to(tl.int64)
        h = tl.program_id(1)
        start, n_valid, base = _chunk_rows(cu_seqlens, chunk_seq, chunk_start, ci, h, H, D)
        q, k, v, g = q + base, k + base, v + base, g + base
        w_out, u_out, qg_out, kg_out = w_out + base, u_out + base, qg_out + base, kg_out + base
        HD = H * D
        rows = tl.arange(0, C)
        valid = rows < n_valid
        io_mask = valid[:, None]
        last = tl.minimum(n_valid, C) - 1
        dt = tl.float32 if F32_DOTS else q.dtype.element_ty
        bt = tl.load(beta + (start + rows) * H + h, mask=valid, other=0.0)
        T = _unit_lower_inverse(akk + (ci * H + h) * C * C, rows, C, BC).to(dt)
        for kb in range(0, D // BK):  # a loop: unrolled, its hoisted loads spilled at 4 warps
            cols = kb * BK + tl.arange(0, BK)
            rel = rows[:, None] * HD + cols[None, :]
            G, g_end = _flat_gate(g, rel, io_mask, last, HD, cols)
            kc = tl.load(k + rel, mask=io_mask, other=0.0).to(tl.float32)
            decay = tl.exp(G)
            tl.store(w_out + rel, tl.dot(T, (kc * decay * bt[:, None]).to(dt)).to(w_out.dtype.element_ty),
                     mask=io_mask)
            tl.store(kg_out + rel, (kc * tl.exp(g_end[None, :] - G)).to(kg_out.dtype.element_ty), mask=io_mask)
            tl.store(gc_out + (ci * H + h) * D + cols, tl.exp(g_end))
            qc = tl.load(q + rel, mask=io_mask, other=0.0).to(tl.float32)
            tl.store(qg_out + rel, (qc * decay * scale).to(qg_out.dtype.element_ty), mask=io_mask)
            vc = tl.load(v + rel, mask=io_mask, other=0.0).to(tl.float32)
            tl.store(u_out + rel, tl.dot(T, (vc * bt[:, None]).to(dt)).to(u_out.dtype.element_ty), mask=io_mask)
