"""KDA decode step (one token per sequence): programs per (sequence, head, value-column block), and its
serving entry `kda_decode_step` with the tuning it launches with.

The step streams each head's fp32 state S [K, V] from HBM and back once; everything else (inputs, conv
windows, taps) is a few hundred bytes. With the whole state in one program (4 warps, 231-250 registers) two
programs fit on an SM (a cap of 168 for three spills and ran slower), so the kernel is shaped around keeping
their state stream busy:
- every read of the step is issued before the state's arrival is waited on, so nothing after it waits on
  memory: the program ends (and frees its registers for the next one) as soon as its arithmetic and stores
  are issued. The order is ptxas's more than ours: it sinks the state's loads below the conv history's and
  the q/k norms' first (shuffle) steps whatever the source order, and moves no load across a barrier. The
  default (STATE_AFTER_INPUTS) issues the inputs' loads, then the state's, then a barrier, and reads the
  output gate and norm weight after it (their layout change otherwise waits on them before the state's
  loads go out): 231 registers instead of 250, 40.6 against 41.2 us at mini's B=64 (one run). The state's
  loads pinned first (before the inputs') measured slower. The new conv windows are stored from registers;
- the state's row and column strides are compile-time constants (one build per pool layout: the dense
  pool and the serving pool's pages share (D, 1)), so one base address serves the whole tile instead of a
  64-bit pointer per row held in registers (254 registers + spills before, 224 and none: Triton 3.9's ptxas);
- heads first in the grid: the H programs of one sequence run together (one slot lookup, one input row);
- streaming cache hints on the state (`evict_first` load, `.cs` store: read and written once per step),
  chosen by the launcher (DECODE_UNHINTED_TILES below: they help at B=64, hurt at B=256).
The delta rule acts on every value column independently (u_j = beta (v_j - S_j^T k)), so a head's columns
can also be split over D // BV programs; only the output RMSNorm needs the whole row: each program parks
its o slice and the last to arrive (an atomic counter per (sequence, head)) normalises the row and writes
the q/k conv windows, which every sibling reads until it is done (decode_triton's split scheme). Measured
slower (more, smaller programs: 42-72 % of copy at B=64 against 83-85 %), kept as the block_v option.
Numbers and everything tried: docs/kernels.md (KDA decode history).
"""

from __future__ import annotations

import torch

from kernels._triton import next_pow2, require, tl, triton
from kernels.fused.rms_norm_rows_triton import rms_normalized
from kernels.kda.decode_triton import (
    _check_tokens,
    _conv_silu,
    _history,
    _norm_parked_rows,
    _raw_input,
    _taps,
    _zeroed_counters,
)

if triton is not None:

    @triton.jit
    def _stream_inputs(x, hist, conv_ch, conv_tap, r, h, offs, H: tl.constexpr, D: tl.constexpr,
                       W: tl.constexpr):
        """One stream's pre-conv inputs at t-3, t-2, t-1 (the pooled window) and t (row 0 of x)."""
        x3, x2, x1 = _history(x, x, hist, conv_ch, conv_tap, r, r, h, 1, 0, offs, H, D, W)
        return x3, x2, x1, _raw_input(x, x, hist, conv_ch, conv_tap, 0, r, r, h, 1, 0, offs, H, D, W)

    @triton.jit
    def _store_window(hist, conv_ch, conv_tap, x2, x1, x0, offs, lim):
        """The new conv window of the channels offs < lim: the inputs at t-2, t-1, t, from registers."""
        mask = offs < lim
        ptrs = hist + offs * conv_ch
        tl.store(ptrs, x2.to(hist.dtype.element_ty), mask=mask)
        tl.store(ptrs + conv_tap, x1.to(hist.dtype.element_ty), mask=mask)
        tl.store(ptrs + 2 * conv_tap, x0.to(hist.dtype.element_ty), mask=mask)

    @triton.jit
    def _output_gate(gate_row, norm_w, offs):
        """The output gate's row and the norm weight (float32) of the channels offs."""
        return tl.load(gate_row + offs).to(tl.float32), tl.load(norm_w + offs).to(tl.float32)

    @triton.jit
    def _load_state(s_ptrs, EVICT_FIRST: tl.constexpr):
        if EVICT_FIRST:  # touched once per step: keep it from evicting the inputs and taps
            return tl.load(s_ptrs, eviction_policy="evict_first")
        else:
            return tl.load(s_ptrs)

    @triton.jit
    def _kda_decode_step_kernel(
        q, k, v, z, beta, gate, conv_w, A_log, dt_bias, norm_w, state, conv_state, slots, out,
        o_scratch, counters,
        q_row, k_row, v_row, z_row, beta_row, gate_row,
        state_slot, state_head, conv_slot, conv_stream, conv_head, conv_ch, conv_tap,
        scale, lower_bound, l2_eps, norm_eps,
        STATE_ROW: tl.constexpr, STATE_COL: tl.constexpr,
        H: tl.constexpr, D: tl.constexpr, W: tl.constexpr, BV: tl.constexpr,
        BOUNDED: tl.constexpr, EVICT_FIRST: tl.constexpr, STREAM_STORE: tl.constexpr, HEADS_FIRST: tl.constexpr,
        STATE_AFTER_INPUTS: tl.constexpr,
    ):
        """Grid (B, H, D // BV), or (H, B, D // BV) with HEADS_FIRST (the programs of one sequence launched
        together): program (b, h, j) owns value columns j*BV.. of head h's state.

        Inputs [B, H, D] (viewed as L = 1 token), beta [B, H], each with its own row stride (x_row: slices
        of one projection GEMM's output need no copy). The pools are addressed by element strides only
        (state: slot, head, then the constant row / column strides; conv: slot, stream, head, channel, tap),
        so a head-interleaved pool page is as good as a dense [slots, H, D, D] tensor."""
        tl.static_assert(W == 4, "the conv window is kept as three registers (4-tap ShortConv)")
        b = tl.program_id(1 if HEADS_FIRST else 0).to(tl.int64)
        h = tl.program_id(0 if HEADS_FIRST else 1).to(tl.int64)
        NV: tl.constexpr = D // BV
        offs = tl.arange(0, D)
        offs_v = tl.program_id(2) * BV + tl.arange(0, BV)
        slot = tl.load(slots + b).to(tl.int64)
        s_ptrs = (state + slot * state_slot + h * state_head
                  + offs[:, None] * STATE_ROW + offs_v[None, :] * STATE_COL)
        if not STATE_AFTER_INPUTS:  # the order before session 9 (ptxas sinks these loads: module docstring)
            S = _load_state(s_ptrs, EVICT_FIRST)
        # Everything the step reads is loaded before the state's arrival is waited on, so that nothing after
        # it waits on memory again (the program's registers are freed sooner).
        r = b * 0  # no replay: a tensor zero keeps _raw_input's masks tensors under the interpreter
        # The shared helpers index [B, L, H, D] inputs from row b; here each input pointer is moved to row b
        # by its own stride and the helpers are given row 0 (r).
        q, k, v = q + b * q_row, k + b * k_row, v + b * v_row
        hist = conv_state + slot * conv_slot + h * conv_head
        hk, hv = hist + conv_stream, hist + 2 * conv_stream
        taps = conv_w + h * D * W
        q3, q2, q1, q0 = _stream_inputs(q, hist, conv_ch, conv_tap, r, h, offs, H, D, W)
        k3, k2, k1, k0 = _stream_inputs(k, hk, conv_ch, conv_tap, r, h, offs, H, D, W)
        v3, v2, v1, v0 = _stream_inputs(v, hv, conv_ch, conv_tap, r, h, offs_v, H, D, W)
        qw0, qw1, qw2, qw3 = _taps(taps, offs, W)
        kw0, kw1, kw2, kw3 = _taps(taps + H * D * W, offs, W)
        vw0, vw1, vw2, vw3 = _taps(taps + 2 * H * D * W, offs_v, W)
        zt = tl.load(z + b * z_row + h * D + offs).to(tl.float32)
        zt += tl.load(dt_bias + h * D + offs).to(tl.float32)
        a_scale = tl.exp(tl.load(A_log + h).to(tl.float32))
        bt = tl.sigmoid(tl.load(beta + b * beta_row + h).to(tl.float32))
        row = (b * H + h) * D  # out's (dense) row; gate_rows + row is this row of gate (its own row stride)
        gate_rows = gate + b * (gate_row - H * D)
        if NV == 1 and not STATE_AFTER_INPUTS:
            g_out, w_out = _output_gate(gate_rows + row, norm_w, offs)
        if STATE_AFTER_INPUTS:
            # The inputs' few loads went out first (so they come back first), the state's right behind them;
            # the barrier keeps ptxas from sinking the state's loads below the rest of the prologue (it still
            # hoists the q/k norms' first shuffles above them). The output gate and norm weight are read after
            # it: their layout change for the output's columns would wait on them before the state's loads.
            S = _load_state(s_ptrs, EVICT_FIRST)
            tl.debug_barrier()
            if NV == 1:
                g_out, w_out = _output_gate(gate_rows + row, norm_w, offs)
        qt = _conv_silu(q3, q2, q1, q0, qw0, qw1, qw2, qw3)
        kt = _conv_silu(k3, k2, k1, k0, kw0, kw1, kw2, kw3)
        vt = _conv_silu(v3, v2, v1, v0, vw0, vw1, vw2, vw3)
        qs = qt * (tl.rsqrt(tl.sum(qt * qt, 0) + l2_eps) * scale)
        kt = kt * tl.rsqrt(tl.sum(kt * kt, 0) + l2_eps)
        if BOUNDED:
            gt = lower_bound * tl.sigmoid(a_scale * zt)
        else:  # Kimi Linear: -exp(A) softplus(z), torch's threshold of 20 kept
            gt = -a_scale * tl.where(zt > 20.0, zt, tl.log(1.0 + tl.exp(zt)))
        S = S * tl.exp(gt)[:, None]
        u = bt * (vt - tl.sum(S * kt[:, None], 0))
        S = S + kt[:, None] * u[None, :]
        if STREAM_STORE:
            tl.store(s_ptrs, S, cache_modifier=".cs")
        else:
            tl.store(s_ptrs, S)
        o = tl.sum(S * qs[:, None], 0)
        _store_window(hv, conv_ch, conv_tap, v2, v1, v0, offs_v, D)
        lim = D  # the q/k windows: written by the one program that has seen every sibling read them
        if NV == 1:
            y = rms_normalized(o, D, norm_eps) * w_out * tl.sigmoid(g_out)
            tl.store(out + row + offs, y.to(out.dtype.element_ty))
        else:
            tl.store(o_scratch + row + offs_v, o)
            # acq_rel: the siblings' o slices (and their reads of the q/k history) happen before.
            arrived = tl.atomic_add(counters + b * H + h, 1)
            lim = tl.where(arrived == NV - 1, D, 0)
        _store_window(hist, conv_ch, conv_tap, q2, q1, q0, offs, lim)
        _store_window(hk, conv_ch, conv_tap, k2, k1, k0, offs, lim)
        if NV > 1:
            _norm_parked_rows(o_scratch, gate_rows, out, norm_w, norm_eps, b, h, 1, offs, lim, H, D)
            tl.atomic_xchg(counters + b * H + h, 0, mask=lim > 0)  # ready for the next launch


def kda_decode_split(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, z: torch.Tensor, beta: torch.Tensor,
    gate: torch.Tensor, conv_weight: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor,
    norm_weight: torch.Tensor, state_pool: torch.Tensor, conv_pool: torch.Tensor, slots: torch.Tensor,
    lower_bound: float | None, scale: float | None, l2_eps: float, norm_eps: float, block_v: int,
    num_warps: int, evict_first: bool = True, stream_store: bool = True, heads_first: bool = False,
    state_after_inputs: bool = True,
) -> torch.Tensor:
    """Launch on inputs already checked (kda_decode_step): [B, H, D] (beta [B, H]) with dense rows (any row
    stride); the pools may be any strided views ([slots, H, D, D] and [slots, 3, H, D, W-1]). All strides
    go to the kernel (the state's row / column strides as build constants). evict_first / stream_store: the
    cache hints on the state's load / store; heads_first: grid order (H, B) instead of (B, H);
    state_after_inputs: the state's loads issued after the inputs' (off: where ptxas puts them)."""
    B, H, D = q.shape
    W = conv_pool.shape[-1] + 1
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    split = block_v < D
    o_scratch = torch.empty(q.shape, dtype=torch.float32, device=q.device) if split else out
    counters = _zeroed_counters(B * H, q.device) if split else slots
    slot_stride, head_stride, row_stride, col_stride = state_pool.stride()
    _kda_decode_step_kernel[(H, B, D // block_v) if heads_first else (B, H, D // block_v)](
        q, k, v, z, beta, gate, conv_weight, A_log, dt_bias, norm_weight, state_pool, conv_pool, slots, out,
        o_scratch, counters,
        *(t.stride(0) for t in (q, k, v, z, beta, gate)), slot_stride, head_stride, *conv_pool.stride(),
        D**-0.5 if scale is None else scale,
        -5.0 if lower_bound is None else lower_bound, l2_eps, norm_eps,
        STATE_ROW=row_stride, STATE_COL=col_stride, H=H, D=D, W=W, BV=block_v, BOUNDED=lower_bound is not None,
        EVICT_FIRST=evict_first, STREAM_STORE=stream_store, HEADS_FIRST=heads_first,
        STATE_AFTER_INPUTS=state_after_inputs, num_warps=num_warps,
    )
    return out


# Decode-step tuning (kernels/perf/kda_decode_cases.py sweeps these): value columns per program (D: the whole
# state in one program), warps, grid order (heads first: the programs of one sequence launched together), and
# the cache hints on the state's load (evict_first) and store (.cs): on below DECODE_UNHINTED_TILES
# (sequence, head) tiles, off from there. Measured on the H200 (docs/kernels.md): the hints win at B=64 x 32
# heads in every run (85.3 against 84.5 % of copy), lose at B=256 x 32 in every run (86.4 against 90.7 %).
# The state's loads are pinned after the inputs' (decode_step_triton): 40.6 against 41.2 us at mini's served
# shape (B=64 x 16 heads, pool view), 8.8 against 9.1 us at B=16, equal at 32 heads (one run, session 9).
DECODE_BLOCK_V, DECODE_WARPS, DECODE_HEADS_FIRST, DECODE_STATE_AFTER_INPUTS = 128, 4, True, True
DECODE_UNHINTED_TILES = 256 * 32


def _dense_rows(t: torch.Tensor) -> torch.Tensor:
    """t itself if all but its row (first) stride are dense (the step takes any row stride), else a copy."""
    dense, step = [], 1
    for size in reversed(t.shape[1:]):
        dense.insert(0, step)
        step *= size
    return t if list(t.stride()[1:]) == dense else t.contiguous()


def kda_decode_step(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, z: torch.Tensor, beta: torch.Tensor,
    gate: torch.Tensor, conv_weight: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor,
    norm_weight: torch.Tensor, state_pool: torch.Tensor, conv_pool: torch.Tensor, slots: torch.Tensor,
    lower_bound: float | None = -5.0, scale: float | None = None, l2_eps: float = 1e-6,
    norm_eps: float = 1e-6, num_warps: int = DECODE_WARPS, block_v: int | None = None,
) -> torch.Tensor:
    """One decode token per sequence: [B, H, D] inputs (beta [B, H]) -> y [B, H, D]; pool updated in place.

    state_pool [slots, H, D, D] and conv_pool [slots, 3, H, D, W-1] may be any strided views (e.g. an
    as_strided view of head-interleaved pages): one launch covers all H heads.

    Programs per (sequence, head, block_v value columns), default DECODE_BLOCK_V (capped at D); streaming
    cache hints on the state below DECODE_UNHINTED_TILES."""
    tokens = [t.unsqueeze(1) for t in (q, k, v, z, beta, gate)]
    _check_tokens(*tokens, conv_weight, A_log, dt_bias, norm_weight, state_pool, conv_pool, slots)
    D = q.shape[-1]
    block_v = min(block_v or DECODE_BLOCK_V, D)
    require(D % block_v == 0 and block_v == next_pow2(block_v), f"block_v must divide {D}, got {block_v}")
    q, k, v, z, beta, gate = (_dense_rows(t) for t in (q, k, v, z, beta, gate))
    hinted = q.shape[0] * q.shape[1] < DECODE_UNHINTED_TILES
    return kda_decode_split(q, k, v, z, beta, gate, conv_weight.contiguous(), A_log, dt_bias.contiguous(),
                            norm_weight, state_pool, conv_pool, slots, lower_bound, scale, l2_eps, norm_eps,
                            block_v, num_warps, hinted, hinted, DECODE_HEADS_FIRST, DECODE_STATE_AFTER_INPUTS)
