"""KDA prefill, passes 3 and 4 of 4: the recurrence across a sequence's chunks, and the output.

From the UT pass's outputs (prefill_chunk_triton.py: w (negated), u, qg, kg, Aqk, exp(G_C) per chunk):
3. the recurrence: per (sequence, head, value block) the state S [K, BV] stays on chip across the chunks:
   v_new = u - w S (w comes negated: one dot onto u),  S <- exp(G_C) * S + kg^T v_new; it stores the
   state entering each chunk (bf16) and v_new, the final state, and (value block 0) the final conv windows.
4. the output: o = qg S_in + Aqk v_new per (chunk, head), then RMSNorm x w x sigmoid(gate) -> y; or, with
   FUSED_OUT, inside the recurrence from the state on chip (the launcher, prefill_triton.py, picks).
"""

from __future__ import annotations

from kernels._triton import tl, triton
from kernels.kda.prefill_chunk_triton import _chunk_head

if triton is not None:

    @triton.jit
    def _gated_rms_store(o, gate, out, tok, mask, norm_w, norm_eps, D: tl.constexpr):
        """y = RMSNorm(o) * w * sigmoid(gate) per row of o [C, D]."""
        weight = tl.load(norm_w + tl.arange(0, D)).to(tl.float32)
        g = tl.load(gate + tok, mask=mask, other=0.0).to(tl.float32)
        y = o * tl.rsqrt(tl.sum(o * o, axis=1) / D + norm_eps)[:, None] * weight[None, :] * tl.sigmoid(g)
        tl.store(out + tok, y.to(out.dtype.element_ty), mask=mask)

    @triton.jit
    def _final_conv_windows(x, init_conv, final_conv, stream, n, h, bos, eos, HAS_CONV: tl.constexpr,
                            H, D: tl.constexpr, W: tl.constexpr, BWM: tl.constexpr):
        """The last W-1 raw inputs of sequence n, head h, one stream, as its [D, W-1] conv window."""
        offs = tl.arange(0, D)[:, None]
        col = tl.arange(0, BWM)[None, :]
        p = eos - (W - 1) + col
        win = tl.load(x + (p * H + h) * D + offs, mask=(p >= bos) & (col < W - 1), other=0.0).to(tl.float32)
        base = ((n * 3 + stream) * H + h) * D * (W - 1) + offs * (W - 1)
        if HAS_CONV:
            carried = (p < bos) & (col < W - 1)
            win += tl.load(init_conv + base + p - bos + (W - 1), mask=carried, other=0.0).to(tl.float32)
        tl.store(final_conv + base + col, win.to(final_conv.dtype.element_ty), mask=col < W - 1)

    @triton.jit
    def _kda_chunk_recurrence_kernel(
        w, u, kg, gc, h_out, vnew_out, init_state, final_state, q, k, v, init_conv, final_conv,
        cu_seqlens, chunk_offsets, seq_order, qg, aqk, gate, norm_w, y_out, norm_eps,
        H, D: tl.constexpr, W: tl.constexpr, BWM: tl.constexpr, C: tl.constexpr,
        BV: tl.constexpr, HAS_STATE: tl.constexpr, HAS_CONV: tl.constexpr, STAGES: tl.constexpr,
        DOT: tl.constexpr, FUSED_OUT: tl.constexpr,
    ):
        """Grid (D // BV, H, sequences), program (iv, h, i) taking sequence seq_order[i] (the sequences by
        chunk count, longest first): the programs start in that order, so the longest sequences' serial
        chains start at once instead of waiting behind short ones, and the value blocks of one (sequence,
        head), which read the same w and kg, run side by side (L2 hits instead of a second HBM read). H200,
        same run, against the order (sequence, head, value block): the varlen batch's recurrence 0.78 -> 0.48
        ms, T=128K 2.00 -> 1.94; the fused B=8 pass 0.859 vs 0.867 (noise).
        FUSED_OUT (BV == D): the output pass happens here, per chunk, from the
        state on chip (o = qg S_in + Aqk v_new, gated RMSNorm -> y): h_out and vnew_out are neither written
        nor read back (1.5 KB per token and head of HBM traffic less), at the cost of one program per
        (sequence, head) doing the output's dots on the serial chain: for many sequences x heads only."""
        iv = tl.program_id(0)
        h = tl.program_id(1)
        n = tl.load(seq_order + tl.program_id(2)).to(tl.int64)
        bos = tl.load(cu_seqlens + n).to(tl.int64)
        eos = tl.load(cu_seqlens + n + 1).to(tl.int64)
        first = tl.load(chunk_offsets + n).to(tl.int64)
        n_chunks = tl.load(chunk_offsets + n + 1).to(tl.int64) - first
        offs = tl.arange(0, D)
        offs_v = iv * BV + tl.arange(0, BV)
        rows = tl.arange(0, C)
        s_offs = ((n * H + h) * D + offs[:, None]) * D + offs_v[None, :]
        if HAS_STATE:
            S = tl.load(init_state + s_offs).to(tl.float32)
        else:
            S = tl.zeros([D, BV], dtype=tl.float32)
        # Pointers move to the sequence's first row once; tiles use 32-bit offsets (registers).
        base = (bos * H + h) * D
        w, u, kg, vnew_out = w + base, u + base, kg + base, vnew_out + base
        qg, gate, y_out = qg + base, gate + base, y_out + base
        aqk += (bos * H + h) * C
        h_out += (first * H + h) * D * D
        gc += (first * H + h) * D
        HD = H * D
        rel_k = rows[:, None] * HD + offs[None, :]
        rel_v = rows[:, None] * HD + offs_v[None, :]
        rel_s = offs[:, None] * D + offs_v[None, :]
        rel_a = rows[:, None] * (H * C) + rows[None, :]
        n_tok = (eos - bos).to(tl.int32)
        for c in tl.range(0, n_chunks, num_stages=STAGES):
            valid = (c * C + rows < n_tok)[:, None]
            step = c * C * HD
            w_c = tl.load(w + step + rel_k, mask=valid, other=0.0)
            u_c = tl.load(u + step + rel_v, mask=valid, other=0.0).to(tl.float32)
            kg_c = tl.load(kg + step + rel_k, mask=valid, other=0.0)
            decay = tl.load(gc + c * H * D + offs)
            S_in = S.to(w_c.dtype)
            v_new = tl.dot(w_c, S_in, acc=u_c, input_precision=DOT).to(kg_c.dtype)  # w_c is -w
            if FUSED_OUT:
                qg_c = tl.load(qg + step + rel_k, mask=valid, other=0.0)
                a_c = tl.load(aqk + c * C * H * C + rel_a, mask=valid, other=0.0)
                o = tl.dot(qg_c, S_in, input_precision=DOT) + tl.dot(a_c, v_new, input_precision=DOT)
                _gated_rms_store(o, gate + step, y_out + step, rel_k, valid, norm_w, norm_eps, D)
            else:
                tl.store(h_out + c * H * D * D + rel_s, S_in)
                tl.store(vnew_out + step + rel_v, v_new.to(vnew_out.dtype.element_ty), mask=valid)
            S = S * decay[:, None] + tl.dot(tl.trans(kg_c), v_new, input_precision=DOT)
        tl.store(final_state + s_offs, S)
        if iv == 0:
            _final_conv_windows(q, init_conv, final_conv, 0, n, h, bos, eos, HAS_CONV, H, D, W, BWM)
            _final_conv_windows(k, init_conv, final_conv, 1, n, h, bos, eos, HAS_CONV, H, D, W, BWM)
            _final_conv_windows(v, init_conv, final_conv, 2, n, h, bos, eos, HAS_CONV, H, D, W, BWM)

    @triton.jit
    def _kda_chunk_output_kernel(
        qg, aqk, h_in, v_new, gate, norm_w, y_out, cu_seqlens, chunk_seq, chunk_start, norm_eps,
        H, D: tl.constexpr, C: tl.constexpr, DOT: tl.constexpr,
    ):
        """Grid (chunks * H,), chunk-major (see _chunk_head): y = gated RMSNorm(qg S_in + Aqk v_new)."""
        ci, h = _chunk_head(H)
        start = tl.load(chunk_start + ci).to(tl.int64)
        n_valid = (tl.load(cu_seqlens + tl.load(chunk_seq + ci) + 1) - start).to(tl.int32)
        rows = tl.arange(0, C)
        offs = tl.arange(0, D)
        valid = (rows < n_valid)[:, None]
        base = (start * H + h) * D  # 32-bit tile offsets from here (registers)
        rel = rows[:, None] * (H * D) + offs[None, :]
        qg_c = tl.load(qg + base + rel, mask=valid, other=0.0)
        a_c = tl.load(aqk + (start * H + h) * C + rows[:, None] * (H * C) + rows[None, :], mask=valid, other=0.0)
        s_in = tl.load(h_in + (ci * H + h) * D * D + offs[:, None] * D + offs[None, :])
        v_c = tl.load(v_new + base + rel, mask=valid, other=0.0)
        o = tl.dot(qg_c, s_in, input_precision=DOT) + tl.dot(a_c, v_c, input_precision=DOT)
        _gated_rms_store(o, gate + base, y_out + base, rel, valid, norm_w, norm_eps, D)
