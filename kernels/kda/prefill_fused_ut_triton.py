"""KDA prefill, passes 1 + 2 in one: the UT transform of a chunk straight from the raw projections.

The same outputs as `prefill_chunk_triton._kda_chunk_ut_kernel` (w negated, u, qg, kg, Aqk, exp(G_C)), but
the prologue (ShortConv + Swish, L2Norm, the bounded gate and its cumsum, sigmoid(beta)) is recomputed here
per key-column block from q, k, v, z and beta instead of being read back from the prep pass's outputs: the
prep's q, k, v (bf16) and G (float32) never go through HBM (2.3 KB less write + read per token and head).
What makes it fit in registers (the first one-kernel prologue needed 255 registers + ~9 KB of spills):
- L2Norm is a row scale, so it is applied after the fact: Akk = diag(rk) Akk_raw diag(rk), Aqk = diag(rq)
  Aqk_raw diag(rk), with the row sums of squares gathered over the key-column blocks as they pass;
- the key rows' decay factors come from the block's own G tile (G is non-increasing in the row, so each
  16-row sub-block's reference G_end is its minimum), so the key sub-block is never reloaded: each
  sub-block's share is a [C, BK] x [BK, C] dot against all keys, the other sub-blocks' keys masked to zero
  (4x the MMA work of [C, 16] dots; the tensor cores idle at ~5 % in this pass anyway);
- the second and third loops recompute the conv outputs they need (their inputs are L2-warm).
"""

from __future__ import annotations

from kernels._triton import tl, triton
from kernels.kda.prefill_chunk_triton import _unit_lower_inverse
from kernels.kda.prefill_prep_triton import _conv_swish, _gate_cumsum

if triton is not None:

    @triton.jit
    def _kda_fused_ut_kernel(
        q, k, v, z, beta, conv_w, A_log, dt_bias, init_conv, cu_seqlens, chunk_seq, chunk_start,
        w_out, u_out, qg_out, kg_out, aqk_out, gc_out, akk_ws, scale, lower_bound, l2_eps,
        H, D: tl.constexpr, W: tl.constexpr, C: tl.constexpr, BC: tl.constexpr, BK: tl.constexpr,
        HAS_CONV: tl.constexpr, F32_DOTS: tl.constexpr, DOT: tl.constexpr, TAP_MAJOR: tl.constexpr,
    ):
        """Grid (chunks, H). Raw token-major [T_total, H, D] projections in (beta [T_total, H], before its
        sigmoid), the UT pass's outputs out (see prefill_chunk_triton); akk_ws [chunks, H, C, C] float32."""
        ci = tl.program_id(0).to(tl.int64)
        h = tl.program_id(1)
        n = tl.load(chunk_seq + ci).to(tl.int64)
        start = tl.load(chunk_start + ci).to(tl.int64)
        lo = (tl.load(cu_seqlens + n) - start).to(tl.int32)
        n_valid = (tl.load(cu_seqlens + n + 1) - start).to(tl.int32)
        base = (start * H + h) * D  # 32-bit tile offsets from here (registers)
        q, k, v, z = q + base, k + base, v + base, z + base
        w_out, u_out, qg_out, kg_out = w_out + base, u_out + base, qg_out + base, kg_out + base
        aqk_out += (start * H + h) * C
        gc_out += (ci * H + h) * D
        dt_bias += h * D
        conv_q = init_conv + ((n * 3 + 0) * H + h) * D * (W - 1)
        conv_k = init_conv + ((n * 3 + 1) * H + h) * D * (W - 1)
        conv_v = init_conv + ((n * 3 + 2) * H + h) * D * (W - 1)
        taps_q = conv_w + h * D * (1 if TAP_MAJOR else W)
        taps_k = taps_q + H * D * W
        taps_v = taps_q + 2 * H * D * W
        HD = H * D
        NB: tl.constexpr = C // BC
        rows = tl.arange(0, C)
        valid = rows < n_valid
        io_mask = valid[:, None]
        dt = tl.float32 if F32_DOTS else q.dtype.element_ty
        a_exp = tl.exp(tl.load(A_log + h).to(tl.float32))
        bt = tl.sigmoid(tl.load(beta + (start + rows) * H + h, mask=valid, other=0.0).to(tl.float32))
        key_blk = tl.arange(0, C) // BC  # the sub-block of each key column of Akk / Aqk
        sub3 = tl.arange(0, NB)[:, None]
        ak = tl.zeros([C, C], dtype=tl.float32)
        aq = tl.zeros([C, C], dtype=tl.float32)
        ssk = tl.zeros([C], dtype=tl.float32)
        ssq = tl.zeros([C], dtype=tl.float32)
        for kb in range(0, D // BK):
            cols = kb * BK + tl.arange(0, BK)
            rel = rows[:, None] * HD + cols[None, :]
            G = _gate_cumsum(z, dt_bias, a_exp, lower_bound, rel, io_mask, cols)
            kc = _conv_swish(k, conv_k, taps_k, rows, lo, valid, cols, HD, HAS_CONV, W, TAP_MAJOR)
            qc = _conv_swish(q, conv_q, taps_q, rows, lo, valid, cols, HD, HAS_CONV, W, TAP_MAJOR)
            ssk += tl.sum(kc * kc, axis=1)
            ssq += tl.sum(qc * qc, axis=1)
            ends = tl.min(tl.reshape(G, [NB, BC, BK]), axis=1)  # G at each sub-block's last row, [NB, BK]
            g_ref = tl.reshape(tl.broadcast_to(ends[:, None, :], [NB, BC, BK]), [C, BK])
            keys = tl.trans((kc * tl.math.exp2(g_ref - G)).to(dt))  # [BK, C], factors <= 1
            for blk in tl.static_range(NB):
                ref = tl.min(tl.where(sub3 == blk, ends, float("inf")), axis=0)
                # rows before the sub-block are causally masked (factor 0); on it <= 2^116, after it <= 1
                row_decay = tl.math.exp2(tl.where(rows[:, None] >= blk * BC, G - ref[None, :], -1e30))
                keys_blk = tl.where(key_blk[None, :] == blk, keys, 0.0)
                ak += tl.dot((kc * row_decay).to(dt), keys_blk, input_precision=DOT)
                aq += tl.dot((qc * row_decay).to(dt), keys_blk, input_precision=DOT)
        rk = tl.rsqrt(ssk + l2_eps)
        rq = tl.rsqrt(ssq + l2_eps)
        kcols = tl.arange(0, C)
        aq = tl.where(kcols[None, :] <= rows[:, None], aq * (rq * scale)[:, None] * rk[None, :], 0.0)
        tl.store(aqk_out + rows[:, None] * (H * C) + kcols[None, :], aq.to(aqk_out.dtype.element_ty), mask=io_mask)
        ws = akk_ws + (ci * H + h) * C * C
        akk = tl.where(kcols[None, :] < rows[:, None], ak * (rk * bt)[:, None] * rk[None, :], 0.0)
        tl.store(ws + rows[:, None] * C + kcols[None, :], akk)
        tl.debug_barrier()
        T = _unit_lower_inverse(ws, rows, C, BC, DOT).to(dt)
        for kb in range(0, D // BK):
            cols = kb * BK + tl.arange(0, BK)
            rel = rows[:, None] * HD + cols[None, :]
            G = _gate_cumsum(z, dt_bias, a_exp, lower_bound, rel, io_mask, cols)
            g_end = tl.min(G, axis=0)
            kc = _conv_swish(k, conv_k, taps_k, rows, lo, valid, cols, HD, HAS_CONV, W, TAP_MAJOR) * rk[:, None]
            decay = tl.math.exp2(G)
            w_blk = tl.dot(T, (kc * decay * -bt[:, None]).to(dt), input_precision=DOT)
            tl.store(w_out + rel, w_blk.to(w_out.dtype.element_ty), mask=io_mask)
            tl.store(kg_out + rel, (kc * tl.math.exp2(g_end[None, :] - G)).to(kg_out.dtype.element_ty), mask=io_mask)
            tl.store(gc_out + cols, tl.math.exp2(g_end))
            qc = _conv_swish(q, conv_q, taps_q, rows, lo, valid, cols, HD, HAS_CONV, W, TAP_MAJOR) * rq[:, None]
            tl.store(qg_out + rel, (qc * decay * scale).to(qg_out.dtype.element_ty), mask=io_mask)
        for vb in range(0, D // BK):
            cols = vb * BK + tl.arange(0, BK)
            rel = rows[:, None] * HD + cols[None, :]
            vc = _conv_swish(v, conv_v, taps_v, rows, lo, valid, cols, HD, HAS_CONV, W, TAP_MAJOR)
            u_blk = tl.dot(T, (vc * bt[:, None]).to(dt), input_precision=DOT).to(u_out.dtype.element_ty)
            tl.store(u_out + rel, u_blk, mask=io_mask)
