"""KDA prefill, pass 1 of 4: the token-local prologue of one chunk of C = 64 tokens of one head.

From the raw projections: ShortConv + Swish of q, k, v (the W-1 inputs before a sequence start come from
the carried conv state), L2Norm of q and k, the bounded gate g = lower_bound * sigmoid(e^A_log (z + b))
and its in-chunk cumulative sum G (float32: it reaches -5 * 64; in log2 units), and sigmoid(beta).
Why a pass of its own: computing all of this inside the chunk's UT-transform kernel kept q, k, G and the
decay factors live as [64, 128] float32 tiles at once (255 registers + ~9 KB of spills per thread, 5.7 of
6.8 ms at B=1, T=32K, H=16 on the H200). Here one stream at a time is live; the bf16 round trip of the
results costs ~9 bytes per element of HBM traffic, far less than the spills did. One program per
(chunk, head, stream): the fewest tiles live at once.
"""

from __future__ import annotations

from kernels._triton import tl, triton

if triton is not None:

    @triton.jit
    def _conv_tap(x, conv, conv_w, rows, lo, valid, offs, HD, s, HAS_CONV: tl.constexpr, W: tl.constexpr):
        """Tap s of the ShortConv: x[row - s] * w[W-1-s], [C, len(offs)] float32 (see _conv_swish)."""
        p = rows - s
        inside = valid & (p >= lo)
        xs = tl.load(x + p[:, None] * HD + offs[None, :], mask=inside[:, None], other=0.0).to(tl.float32)
        if HAS_CONV:
            carried = valid & (p < lo)
            xs += tl.load(conv + offs[None, :] * (W - 1) + (p - lo + W - 1)[:, None], mask=carried[:, None],
                          other=0.0).to(tl.float32)
        # tap-major weights: one vector load of the tap's channels (channel-major took one 16-bit load each)
        return xs * tl.load(conv_w + (W - 1 - s) * HD + offs).to(tl.float32)[None, :]

    @triton.jit
    def _conv_swish(x, conv, conv_w, rows, lo, valid, offs, HD, HAS_CONV: tl.constexpr, W: tl.constexpr):
        """Swish(ShortConv) of one stream at the chunk's rows [C], channels offs (of D), as [C, len(offs)]
        float32. x points at the chunk's first row of this head (rows are HD elements apart); rows before
        `lo` (the sequence start, relative) come from the carried conv window `conv` [D, W-1] (zeros without
        one); rows that are not `valid` come out zero. Without a carried window the taps are unrolled, so that
        their loads overlap (in a loop each waited for the previous one: 0.66 vs 0.51 ms at B=1, T=32K, H=16
        on the H200); with one, unrolled taps need 255 registers and spill (sm_90a, 8 warps), the loop 200.
        conv_w: this stream's and head's taps, tap-major: [W, D] with rows HD apart (the launcher transposes
        the [3, H*D, W] weights to [3, W, H*D])."""
        acc = tl.zeros([rows.shape[0], offs.shape[0]], dtype=tl.float32)
        if HAS_CONV:
            for s in range(W):
                acc += _conv_tap(x, conv, conv_w, rows, lo, valid, offs, HD, s, HAS_CONV, W)
        else:
            for s in tl.static_range(W):
                acc += _conv_tap(x, conv, conv_w, rows, lo, valid, offs, HD, s, HAS_CONV, W)
        return acc * tl.sigmoid(acc)

    @triton.jit
    def _kda_prep_kernel(
        q, k, v, z, beta, conv_w, A_log, dt_bias, init_conv, cu_seqlens, chunk_seq, chunk_start,
        q_out, k_out, v_out, g_out, beta_out, lower_bound, l2_eps,
        H, D: tl.constexpr, W: tl.constexpr, C: tl.constexpr, HAS_CONV: tl.constexpr,
    ):
        """Grid (chunks, H, 3): program (., ., 0) does q, 1 k, 2 v and the gate and beta (a fourth program
        for the gate and beta measured slower: 0.505 vs 0.490 ms at B=1, T=32K, H=16). Token-major
        [T_total, H, D] in and out (g_out float32), beta_out [T_total, H]. Tile offsets are 32-bit, from the
        chunk's first row (64-bit ones cost registers; the conv taps before the chunk are negative rows)."""
        ci = tl.program_id(0)
        h = tl.program_id(1)
        stream = tl.program_id(2)
        n = tl.load(chunk_seq + ci).to(tl.int64)
        start = tl.load(chunk_start + ci).to(tl.int64)
        lo = (tl.load(cu_seqlens + n) - start).to(tl.int32)
        n_valid = (tl.load(cu_seqlens + n + 1) - start).to(tl.int32)
        base = (start * H + h) * D
        offs = tl.arange(0, D)
        rows = tl.arange(0, C)
        HD = H * D
        valid = rows < n_valid
        rel = rows[:, None] * HD + offs[None, :]
        io_mask = valid[:, None]
        # One stream per program: with all three in one, their loads were hoisted together (255 registers).
        if stream == 0:
            x, out = q, q_out
        elif stream == 1:
            x, out = k, k_out
        else:
            x, out = v, v_out
        conv = init_conv + ((n * 3 + stream) * H + h) * D * (W - 1)
        taps = conv_w + stream * H * D * W + h * D
        xt = _conv_swish(x + base, conv, taps, rows, lo, valid, offs, HD, HAS_CONV, W)
        if stream < 2:
            xt = xt * tl.rsqrt(tl.sum(xt * xt, axis=1) + l2_eps)[:, None]
        tl.store(out + base + rel, xt.to(out.dtype.element_ty), mask=io_mask)
        if stream == 2:
            zt = tl.load(z + base + rel, mask=io_mask, other=0.0).to(tl.float32)
            zt += tl.load(dt_bias + h * D + offs).to(tl.float32)[None, :]
            # In log2 units (G * log2(e)): the UT pass then forms its decay factors with bare exp2.
            g = (lower_bound * 1.4426950408889634) * tl.sigmoid(tl.exp(tl.load(A_log + h).to(tl.float32)) * zt)
            tl.store(g_out + base + rel, tl.cumsum(tl.where(io_mask, g, 0.0), axis=0), mask=io_mask)
            bt = tl.sigmoid(tl.load(beta + (start + rows) * H + h, mask=valid, other=0.0).to(tl.float32))
            tl.store(beta_out + (start + rows) * H + h, bt, mask=valid)
