"""KDA prefill, pass 1 of 3, K-blocked form: the outputs of prefill_chunk_triton.py with the key dimension
walked in BK-column blocks, so that only [C, BK] tiles are live at a time.

Why: the full-width form holds q, k, G and a decay factor as [64, 128] float32 tiles at once; ptxas
reports 255 registers and ~9-12 KB of spills per thread at 4 warps (even the gate + cumsum alone fills
the register file), and that prologue took 5.7 of 6.8 ms at B=1, T=32K, H=16 on the H200.
Here every per-channel quantity is computed per column block:
- pass 1 (per block): gate, cumsum G, ShortConv + Swish of q and k (not yet normalised), the decay
  products of the block (masked key sub-block tiles, 2-D dots in the input dtype, as fla's bf16 operands),
  and the squared norms. L2Norm is a per-row scale, so it is applied to Akk / Aqk afterwards.
- the inverse T of the whole chunk ([C, C]: the same routine as the full-width form).
- pass 2 (per block): G, q, k again (the conv re-reads the inputs from L1/L2), then qg, kg, exp(G_C), w;
  then v per block for u.
"""

from __future__ import annotations

from kernels._triton import tl, triton
from kernels.kda.prefill_chunk_triton import _conv_swish, _unit_lower_inverse

if triton is not None:

    @triton.jit
    def _gate_cumsum(z, dt_bias, a_scale, lower_bound, tok, cols, io_mask, h, D: tl.constexpr):
        """In-chunk cumulative bounded gate of the channels `cols`, [C, BK]; zero gate on padding rows."""
        zt = tl.load(z + tok, mask=io_mask, other=0.0).to(tl.float32)
        zt += tl.load(dt_bias + h * D + cols).to(tl.float32)[None, :]
        g = lower_bound * tl.sigmoid(a_scale * zt)
        return tl.cumsum(tl.where(io_mask, g, 0.0), axis=0)

    @triton.jit
    def _kda_chunk_prologue_kblock_kernel(
        q, k, v, z, beta, conv_w, A_log, dt_bias, init_conv, cu_seqlens, chunk_seq, chunk_start,
        w_out, u_out, qg_out, kg_out, aqk_out, gc_out,
        scale, lower_bound, l2_eps,
        H, D: tl.constexpr, W: tl.constexpr, C: tl.constexpr, BC: tl.constexpr, BK: tl.constexpr,
        HAS_CONV: tl.constexpr,
    ):
        """Grid (chunks, H); the arguments of _kda_chunk_prologue_kernel plus BK (a divisor of D)."""
        ci = tl.program_id(0)
        h = tl.program_id(1)
        n = tl.load(chunk_seq + ci).to(tl.int64)
        bos = tl.load(cu_seqlens + n).to(tl.int64)
        eos = tl.load(cu_seqlens + n + 1).to(tl.int64)
        rows = tl.arange(0, C)
        cols_c = tl.arange(0, C)
        t = tl.load(chunk_start + ci).to(tl.int64) + rows
        valid = t < eos
        io_mask = valid[:, None]
        dt = q.dtype.element_ty
        a_scale = tl.exp(tl.load(A_log + h).to(tl.float32))
        NB: tl.constexpr = C // BC
        akk = tl.zeros([C, C], dtype=tl.float32)
        aqk = tl.zeros([C, C], dtype=tl.float32)
        ssq_k = tl.zeros([C], dtype=tl.float32)
        ssq_q = tl.zeros([C], dtype=tl.float32)
        for kb in range(0, D // BK):
            cols = kb * BK + tl.arange(0, BK)
            tok = (t[:, None] * H + h) * D + cols[None, :]
            G = _gate_cumsum(z, dt_bias, a_scale, lower_bound, tok, cols, io_mask, h, D)
            kc = _conv_swish(k, init_conv, conv_w, 1, n, h, t, bos, valid, cols, HAS_CONV, H, D, W)
            qc = _conv_swish(q, init_conv, conv_w, 0, n, h, t, bos, valid, cols, HAS_CONV, H, D, W)
            ssq_k += tl.sum(kc * kc, axis=1)
            ssq_q += tl.sum(qc * qc, axis=1)
            for blk in tl.static_range(NB):
                # Split at the end of key sub-block blk (see prefill_chunk_triton.py): factors <= 1 off the
                # diagonal block, <= e^80 on it; rows before the block are causally masked (factor 0 here).
                ref = tl.sum(tl.where(rows[:, None] == blk * BC + BC - 1, G, 0.0), axis=0)
                row_decay = tl.exp(tl.where(rows[:, None] >= blk * BC, G - ref[None, :], -1e30))
                in_blk = (rows // BC == blk)[:, None]
                k_col = tl.where(in_blk, kc * tl.exp(tl.where(in_blk, ref[None, :] - G, 0.0)), 0.0)
                k_col = tl.trans(k_col.to(dt))
                akk += tl.dot((kc * row_decay).to(dt), k_col)
                aqk += tl.dot((qc * row_decay).to(dt), k_col)
        rk = tl.rsqrt(ssq_k + l2_eps)
        rq = tl.rsqrt(ssq_q + l2_eps)
        bt = tl.sigmoid(tl.load(beta + t * H + h, mask=valid, other=0.0).to(tl.float32))
        bt = tl.where(valid, bt, 0.0)
        aqk = tl.where(cols_c[None, :] <= rows[:, None], aqk * (rq * scale)[:, None] * rk[None, :], 0.0)
        tl.store(aqk_out + (t[:, None] * H + h) * C + cols_c[None, :], aqk.to(aqk_out.dtype.element_ty),
                 mask=io_mask)
        akk = tl.where(cols_c[None, :] < rows[:, None], akk * (rk * bt)[:, None] * rk[None, :], 0.0)
        T = _unit_lower_inverse(akk, rows, C, BC).to(dt)
        for kb in range(0, D // BK):
            cols = kb * BK + tl.arange(0, BK)
            tok = (t[:, None] * H + h) * D + cols[None, :]
            G = _gate_cumsum(z, dt_bias, a_scale, lower_bound, tok, cols, io_mask, h, D)
            kc = _conv_swish(k, init_conv, conv_w, 1, n, h, t, bos, valid, cols, HAS_CONV, H, D, W) * rk[:, None]
            qc = _conv_swish(q, init_conv, conv_w, 0, n, h, t, bos, valid, cols, HAS_CONV, H, D, W) * rq[:, None]
            decay = tl.exp(G)
            tl.store(qg_out + tok, (qc * decay * scale).to(qg_out.dtype.element_ty), mask=io_mask)
            g_end = tl.sum(tl.where(rows[:, None] == C - 1, G, 0.0), axis=0)
            tl.store(kg_out + tok, (kc * tl.exp(g_end[None, :] - G)).to(kg_out.dtype.element_ty), mask=io_mask)
            tl.store(gc_out + (ci * H + h) * D + cols, tl.exp(g_end))
            w_blk = tl.dot(T, (kc * decay * bt[:, None]).to(dt))
            tl.store(w_out + tok, w_blk.to(w_out.dtype.element_ty), mask=io_mask)
        for vb in range(0, D // BK):
            cols = vb * BK + tl.arange(0, BK)
            tok = (t[:, None] * H + h) * D + cols[None, :]
            vc = _conv_swish(v, init_conv, conv_w, 2, n, h, t, bos, valid, cols, HAS_CONV, H, D, W)
            tl.store(u_out + tok, tl.dot(T, (vc * bt[:, None]).to(dt)).to(u_out.dtype.element_ty), mask=io_mask)
