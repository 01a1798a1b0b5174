"""KDA prefill, pass 1 of 3: everything that is local to one chunk of C = 64 tokens of one head.

From the raw projections it computes ShortConv + Swish (q, k, v), L2Norm (q, k), the bounded gate and its
in-chunk cumulative sum G, sigmoid(beta), and then the chunk's UT transform (K3 report eq.4, the WY form
of Kimi Linear; notation of k3core/ops/kda_chunk.py):
    Akk[r, i] = sum_c k_r k_i exp(G_r - G_i)  (i < r),   T = (I + diag(beta) Akk)^-1
    w = T diag(beta) (K * exp(G)),  u = T diag(beta) V,  Aqk = scale * sum_c q_r k_i exp(G_r - G_i) (i <= r)
    qg = scale * Q * exp(G),  kg = K * exp(G_C - G),  gC = exp(G_C)
which is all the inter-chunk recurrence (prefill_triton.py) needs: the conv/norm/gate outputs never reach
memory. The gate is bounded (g >= lower_bound = -5), so within a sub-block of 16 tokens G moves by at
most 80 and exp(+-80) fits float32: the decay ratios exp(G_r - G_i) are split at the end of the key's
sub-block (every factor <= 1 off the diagonal block, <= e^80 on it), which lets tensor-core dots form them.
"""

from __future__ import annotations

from kernels._triton import tl, triton

CHUNK = 64
SUB = 16  # sub-block of the decay split: |lower_bound| * SUB must stay below ~88 (float32 exp range)

if triton is not None:

    @triton.jit
    def _conv_swish(x, init_conv, conv_w, stream, n, h, t, bos, valid, offs, HAS_CONV: tl.constexpr,
                    H, D: tl.constexpr, W: tl.constexpr):
        """Swish(ShortConv) of one stream (0 q, 1 k, 2 v) at tokens t [C] of head h, channels offs (of D),
        as [C, len(offs)] float32.

        Inputs before the sequence start `bos` come from the carried conv state [N, 3, H, D, W-1] (zeros
        without one); rows that are not `valid` come out zero."""
        acc = tl.zeros([t.shape[0], offs.shape[0]], dtype=tl.float32)
        for s in tl.static_range(W):
            p = t - s
            inside = valid & (p >= bos)
            xs = tl.load(x + (p[:, None] * H + h) * D + offs[None, :], mask=inside[:, None], other=0.0)
            xs = xs.to(tl.float32)
            if HAS_CONV:
                carried = valid & (p < bos)
                col = p - bos + (W - 1)
                base = init_conv + ((n * 3 + stream) * H + h) * D * (W - 1)
                xs += tl.load(base + offs[None, :] * (W - 1) + col[:, None], mask=carried[:, None],
                              other=0.0).to(tl.float32)
            tap = tl.load(conv_w + (stream * H * D + h * D + offs) * W + (W - 1 - s)).to(tl.float32)
            acc += xs * tap[None, :]
        return acc * tl.sigmoid(acc)

    @triton.jit
    def _block_of(x, blk, NB: tl.constexpr, BC: tl.constexpr, D: tl.constexpr):
        """Rows blk*BC .. blk*BC+BC-1 of a [NB*BC, D] tile, as [BC, D]."""
        x3 = tl.reshape(x, [NB, BC, D])
        return tl.sum(tl.where(tl.arange(0, NB)[:, None, None] == blk, x3, 0.0), axis=0)

    @triton.jit
    def _decay_products(q, k, G, rows, C: tl.constexpr, BC: tl.constexpr, D: tl.constexpr):
        """(sum_c k_r k_i e^(G_r - G_i), sum_c q_r k_i e^(G_r - G_i)) for all r, i as [C, C], unmasked
        where i is in a later sub-block than r (those entries are set to zero, not computed)."""
        NB: tl.constexpr = C // BC
        acc_k = tl.zeros([C, NB, BC], dtype=tl.float32)
        acc_q = tl.zeros([C, NB, BC], dtype=tl.float32)
        slot = tl.arange(0, NB)[None, :, None]
        for blk in tl.static_range(NB):
            ref = tl.sum(tl.where(rows[:, None] == blk * BC + BC - 1, G, 0.0), axis=0)  # G at the block end
            # Rows before the key block would need e^(positive, unbounded): they are causally masked anyway.
            row_decay = tl.exp(tl.where(rows[:, None] >= blk * BC, G - ref[None, :], -1e30))
            k_col = _block_of(k, blk, NB, BC, D) * tl.exp(ref[None, :] - _block_of(G, blk, NB, BC, D))
            part_k = tl.dot(k * row_decay, tl.trans(k_col))
            part_q = tl.dot(q * row_decay, tl.trans(k_col))
            acc_k = tl.where(slot == blk, part_k[:, None, :], acc_k)
            acc_q = tl.where(slot == blk, part_q[:, None, :], acc_q)
        return tl.reshape(acc_k, [C, C]), tl.reshape(acc_q, [C, C])

    @triton.jit
    def _unit_lower_inverse(M, rows, C: tl.constexpr, BC: tl.constexpr):
        """(I + M)^-1 for strictly lower-triangular M [C, C]: forward substitution inside each BC x BC
        diagonal block (float32), then the block off-diagonal terms by the nilpotent series with dots:
        (D + L)^-1 = (I - N + N^2 - N^3) D^-1, N = D^-1 L, since N^4 = 0 for C / BC = 4 blocks."""
        NB: tl.constexpr = C // BC
        tl.static_assert(NB == 4, "the series below stops at N^3: exactly 4 sub-blocks per chunk")
        same = tl.arange(0, NB)[:, None, None, None] == tl.arange(0, NB)[None, None, :, None]
        diag = tl.sum(tl.where(same, tl.reshape(M, [NB, BC, NB, BC]), 0.0), axis=2)  # [NB, BC, BC]
        r3 = tl.arange(0, BC)[None, :, None]
        j3 = tl.arange(0, BC)[None, None, :]
        X = tl.where(r3 == j3, 1.0, 0.0) + tl.zeros([NB, BC, BC], dtype=tl.float32)
        for i in tl.static_range(1, BC):
            m_i = tl.sum(tl.where(r3 == i, diag, 0.0), axis=1)  # row i of each block, [NB, BC]
            x_i = tl.sum(m_i[:, :, None] * X, axis=1)
            X = tl.where(r3 == i, tl.where(j3 == i, 1.0, 0.0) - x_i[:, None, :], X)
        d_inv = tl.reshape(tl.where(same, X[:, :, None, :], 0.0), [C, C])
        cols = tl.arange(0, C)
        lower = tl.where(rows[:, None] // BC > cols[None, :] // BC, M, 0.0)
        N = tl.dot(d_inv, lower)
        N2 = tl.dot(N, N)
        N3 = tl.dot(N2, N)
        eye = tl.where(rows[:, None] == cols[None, :], 1.0, 0.0)
        return tl.dot(eye - N + N2 - N3, d_inv)

    @triton.jit
    def _kda_chunk_prologue_kernel(
        q, k, v, z, beta, conv_w, A_log, dt_bias, init_conv, cu_seqlens, chunk_seq, chunk_start,
        w_out, u_out, qg_out, kg_out, aqk_out, gc_out,
        scale, lower_bound, l2_eps,
        H, D: tl.constexpr, W: tl.constexpr, C: tl.constexpr, BC: tl.constexpr,
        HAS_CONV: tl.constexpr,
    ):
        """Grid (chunks, H). Token-major [T_total, H, *] in and out; gc_out [chunks, H, D]."""
        ci = tl.program_id(0)
        h = tl.program_id(1)
        n = tl.load(chunk_seq + ci).to(tl.int64)
        bos = tl.load(cu_seqlens + n).to(tl.int64)
        eos = tl.load(cu_seqlens + n + 1).to(tl.int64)
        rows = tl.arange(0, C)
        offs = tl.arange(0, D)
        t = tl.load(chunk_start + ci).to(tl.int64) + rows
        valid = t < eos
        tok = (t[:, None] * H + h) * D + offs[None, :]
        io_mask = valid[:, None]
        # Gate (eq.5), zero on padding rows so that G stays flat there and G[C-1] is the chunk's end.
        zt = tl.load(z + tok, mask=io_mask, other=0.0).to(tl.float32)
        zt += tl.load(dt_bias + h * D + offs).to(tl.float32)[None, :]
        g = lower_bound * tl.sigmoid(tl.exp(tl.load(A_log + h).to(tl.float32)) * zt)
        G = tl.cumsum(tl.where(io_mask, g, 0.0), axis=0)
        kt = _conv_swish(k, init_conv, conv_w, 1, n, h, t, bos, valid, offs, HAS_CONV, H, D, W)
        kt = kt * tl.rsqrt(tl.sum(kt * kt, axis=1) + l2_eps)[:, None]
        qt = _conv_swish(q, init_conv, conv_w, 0, n, h, t, bos, valid, offs, HAS_CONV, H, D, W)
        qt = qt * tl.rsqrt(tl.sum(qt * qt, axis=1) + l2_eps)[:, None]
        bt = tl.sigmoid(tl.load(beta + t * H + h, mask=valid, other=0.0).to(tl.float32))
        bt = tl.where(valid, bt, 0.0)
        akk, aqk = _decay_products(qt, kt, G, rows, C, BC, D)
        cols = tl.arange(0, C)
        aqk = tl.where(cols[None, :] <= rows[:, None], aqk * scale, 0.0)
        tl.store(aqk_out + (t[:, None] * H + h) * C + cols[None, :], aqk.to(aqk_out.dtype.element_ty),
                 mask=io_mask)
        tl.store(qg_out + tok, (qt * tl.exp(G) * scale).to(qg_out.dtype.element_ty), mask=io_mask)
        akk = tl.where(cols[None, :] < rows[:, None], akk * bt[:, None], 0.0)
        T = _unit_lower_inverse(akk, rows, C, BC)
        tl.store(w_out + tok, tl.dot(T, kt * tl.exp(G) * bt[:, None]).to(w_out.dtype.element_ty), mask=io_mask)
        g_end = tl.sum(tl.where(rows[:, None] == C - 1, G, 0.0), axis=0)
        tl.store(kg_out + tok, (kt * tl.exp(g_end[None, :] - G)).to(kg_out.dtype.element_ty), mask=io_mask)
        tl.store(gc_out + (ci * H + h) * D + offs, tl.exp(g_end))
        vt = _conv_swish(v, init_conv, conv_w, 2, n, h, t, bos, valid, offs, HAS_CONV, H, D, W)
        tl.store(u_out + tok, tl.dot(T, vt * bt[:, None]).to(u_out.dtype.element_ty), mask=io_mask)
