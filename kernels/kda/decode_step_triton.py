"""KDA decode step (one token per sequence): one program per (sequence, head), state walked in value tiles.

The delta rule acts on every value column of the state S [K, V] independently (u_j = beta (v_j - S_j^T k)),
so a program can walk its state in [K, BV] tiles: load, decay, update, store and read out each tile in
turn (tl.range stages keep the next tile's load in flight); only the output RMSNorm needs the whole row,
so the tiles' outputs stay on chip ([V / BV, BV]) and are normalised at the end. q/k conv + L2Norm once.
Measured on the H200 (docs/kernels.md): smaller tiles lose (32 columns 65-67 % of copy at B=64); the whole
state as one tile wins (76 %), and streaming cache hints on the state (read and written once per step)
take it to 83 %. Unlike decode_triton.py's recurrent kernel, there is no replay, snapshot or commit logic.
"""

from __future__ import annotations

import torch

from kernels._triton import next_pow2, tl, triton
from kernels.kda.decode_triton import (
    _conv_silu,
    _history,
    _raw_input,
    _taps,
    _write_conv_window,
)

if triton is not None:

    @triton.jit
    def _kda_decode_tiled_kernel(
        q, k, v, z, beta, gate, conv_w, A_log, dt_bias, norm_w, state, conv_state, slots, out,
        q_row, k_row, v_row, z_row, beta_row, gate_row,
        state_slot, state_head, state_row, state_col, conv_slot, conv_stream, conv_head, conv_ch, conv_tap,
        scale, lower_bound, l2_eps, norm_eps,
        H: tl.constexpr, D: tl.constexpr, W: tl.constexpr, BWM: tl.constexpr, BV: tl.constexpr,
        BOUNDED: tl.constexpr, STAGES: tl.constexpr, STREAMING: tl.constexpr,
    ):
        """Grid (B, H); inputs [B, H, D] (viewed as L = 1 token), beta [B, H], each with its own row stride
        (x_row: slices of one projection GEMM's output need no copy). The pools are addressed by element
        strides only (state: slot, head, row, column; conv: slot, stream, head, channel, tap), so a
        head-interleaved pool page is as good as a dense [slots, H, D, D] tensor."""
        b = tl.program_id(0).to(tl.int64)
        h = tl.program_id(1).to(tl.int64)
        NT: tl.constexpr = D // BV
        offs = tl.arange(0, D)
        slot = tl.load(slots + b).to(tl.int64)
        r = b * 0  # no replay: a tensor zero keeps _raw_input's masks tensors under the interpreter
        # The shared helpers index [B, L, H, D] inputs from row b; here each input pointer is moved to row b
        # by its own stride and the helpers are given row 0 (r).
        q, k, v = q + b * q_row, k + b * k_row, v + b * v_row
        hist = conv_state + slot * conv_slot + h * conv_head
        hk, hv = hist + conv_stream, hist + 2 * conv_stream
        taps = conv_w + h * D * W
        q3, q2, q1 = _history(q, q, hist, conv_ch, conv_tap, r, r, h, 1, 0, offs, H, D, W)
        qw0, qw1, qw2, qw3 = _taps(taps, offs, W)
        xq = _raw_input(q, q, hist, conv_ch, conv_tap, 0, r, r, h, 1, 0, offs, H, D, W)
        qt = _conv_silu(q3, q2, q1, xq, qw0, qw1, qw2, qw3)
        k3, k2, k1 = _history(k, k, hk, conv_ch, conv_tap, r, r, h, 1, 0, offs, H, D, W)
        kw0, kw1, kw2, kw3 = _taps(taps + H * D * W, offs, W)
        xk = _raw_input(k, k, hk, conv_ch, conv_tap, 0, r, r, h, 1, 0, offs, H, D, W)
        kt = _conv_silu(k3, k2, k1, xk, kw0, kw1, kw2, kw3)
        qt = qt * tl.rsqrt(tl.sum(qt * qt, 0) + l2_eps)
        kt = kt * tl.rsqrt(tl.sum(kt * kt, 0) + l2_eps)
        zt = tl.load(z + b * z_row + h * D + offs).to(tl.float32)
        zt += tl.load(dt_bias + h * D + offs).to(tl.float32)
        a_scale = tl.exp(tl.load(A_log + h).to(tl.float32))
        if BOUNDED:
            gt = lower_bound * tl.sigmoid(a_scale * zt)
        else:  # Kimi Linear: -exp(A) softplus(z), torch's threshold of 20 kept
            gt = -a_scale * tl.where(zt > 20.0, zt, tl.log(1.0 + tl.exp(zt)))
        decay = tl.exp(gt)
        bt = tl.sigmoid(tl.load(beta + b * beta_row + h).to(tl.float32))
        qs = qt * scale
        s_base = state + slot * state_slot + h * state_head
        tiles = tl.arange(0, NT)
        o_all = tl.zeros([NT, BV], dtype=tl.float32)
        for j in tl.range(0, NT, num_stages=STAGES):
            offs_v = j * BV + tl.arange(0, BV)
            s_ptrs = s_base + offs[:, None] * state_row + offs_v[None, :] * state_col
            if STREAMING:  # the state is touched once per step: keep it from evicting the inputs and taps
                S = tl.load(s_ptrs, eviction_policy="evict_first") * decay[:, None]
            else:
                S = tl.load(s_ptrs) * decay[:, None]
            v3, v2, v1 = _history(v, v, hv, conv_ch, conv_tap, r, r, h, 1, 0, offs_v, H, D, W)
            vw0, vw1, vw2, vw3 = _taps(taps + 2 * H * D * W, offs_v, W)
            xv = _raw_input(v, v, hv, conv_ch, conv_tap, 0, r, r, h, 1, 0, offs_v, H, D, W)
            vt = _conv_silu(v3, v2, v1, xv, vw0, vw1, vw2, vw3)
            u = bt * (vt - tl.sum(S * kt[:, None], 0))
            S = S + kt[:, None] * u[None, :]
            if STREAMING:
                tl.store(s_ptrs, S, cache_modifier=".cs")
            else:
                tl.store(s_ptrs, S)
            o_all = tl.where(tiles[:, None] == j, tl.sum(S * qs[:, None], 0)[None, :], o_all)
            _write_conv_window(v, v, hv, conv_ch, conv_tap, 1, r, r, h, 1, 0, offs_v, H, D, W, BWM, BV, D)
        cols = tiles[:, None] * BV + tl.arange(0, BV)[None, :]
        g = tl.load(gate + b * gate_row + h * D + cols).to(tl.float32)
        y = o_all * tl.rsqrt(tl.sum(tl.sum(o_all * o_all, 1), 0) / D + norm_eps)
        y = y * tl.load(norm_w + cols).to(tl.float32) * tl.sigmoid(g)
        tl.store(out + (b * H + h) * D + cols, y.to(out.dtype.element_ty))
        _write_conv_window(q, q, hist, conv_ch, conv_tap, 1, r, r, h, 1, 0, offs, H, D, W, BWM, D, D)
        _write_conv_window(k, k, hk, conv_ch, conv_tap, 1, r, r, h, 1, 0, offs, H, D, W, BWM, D, D)


def kda_decode_tiled(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, z: torch.Tensor, beta: torch.Tensor,
    gate: torch.Tensor, conv_weight: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor,
    norm_weight: torch.Tensor, state_pool: torch.Tensor, conv_pool: torch.Tensor, slots: torch.Tensor,
    lower_bound: float | None, scale: float | None, l2_eps: float, norm_eps: float, tile_v: int,
    num_warps: int, stages: int, streaming: bool = False,
) -> torch.Tensor:
    """Launch on inputs already checked by decode_triton: [B, H, D] (beta [B, H]) with dense rows (any row
    stride); the pools may be any strided views ([slots, H, D, D] and [slots, 3, H, D, W-1]). All strides
    go to the kernel."""
    B, H, D = q.shape
    W = conv_pool.shape[-1] + 1
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    _kda_decode_tiled_kernel[(B, H)](
        q, k, v, z, beta, gate, conv_weight, A_log, dt_bias, norm_weight, state_pool, conv_pool, slots, out,
        *(t.stride(0) for t in (q, k, v, z, beta, gate)), *state_pool.stride(), *conv_pool.stride(),
        D**-0.5 if scale is None else scale,
        -5.0 if lower_bound is None else lower_bound, l2_eps, norm_eps,
        H=H, D=D, W=W, BWM=next_pow2(W - 1), BV=tile_v, BOUNDED=lower_bound is not None, STAGES=stages,
        STREAMING=streaming, num_warps=num_warps,
    )
    return out
