"""Fused KDA token-recurrent kernel on the paged state pool: decode step and replay verify (§5.4.2).

One program per (sequence, head) loads the fp32 state S [K, V] once, runs every token of the sequence
through ShortConv + Swish (q, k, v), L2Norm (q, k), the gate (bounded or softplus), sigmoid(beta), the
gated delta rule and the output RMSNorm x sigmoid gate, all on chip, and writes S back once. The decode
step is one new token; the replay verify prepends the cached projected inputs of accepted draft tokens
(replayed, no output) so that only the verified state ever reaches memory. The served one-token step
(`kda_decode_step`) runs its own kernel, built from this module's device functions: decode_step_triton.py.

Virtual token positions of one sequence: [conv history (W-1) | replay (r_b) | new (L)]; the conv history is
the pool's conv state, channel-major [3, H, D, W-1] per slot (k3core.ops.short_conv convention).

The pools are addressed through their element strides (state_pool [slots, H, D, D], conv_pool
[slots, 3, H, D, W-1], any strides), so one launch covers all heads of a layer also where the heads of a
slot are not D*D apart: the serving pool's head-interleaved KDA pages (k3core/cache/pool_views.py).
"""

from __future__ import annotations

import torch

from kernels._triton import next_pow2, require, tl, triton
from kernels.fused.rms_norm_rows_triton import rms_normalized

if triton is not None:

    @triton.jit
    def _raw_input(new, rep, hist, conv_ch, conv_tap, p, r, b, h, L, R, offs, H: tl.constexpr,
                   D: tl.constexpr, W: tl.constexpr):
        """Pre-conv input of one stream at virtual position p (< 0: conv history, < r: replay, else new).

        hist: this head's window of the stream, conv_ch / conv_tap: its channel and tap strides."""
        # Masks are `offs < limit` with a scalar limit of D or 0: one comparison, no scalar-vector `&`
        # (which the interpreter mistypes).
        x = tl.load(hist + offs * conv_ch + (W - 1 + p) * conv_tap, mask=offs < tl.where(p < 0, D, 0),
                    other=0.0)
        in_rep = tl.where(p >= 0, tl.where(p < r, D, 0), 0)
        x = x.to(tl.float32) + tl.load(rep + ((b * R + p) * H + h) * D + offs, mask=offs < in_rep,
                                       other=0.0).to(tl.float32)
        x += tl.load(new + ((b * L + (p - r)) * H + h) * D + offs, mask=offs < tl.where(p >= r, D, 0),
                     other=0.0).to(tl.float32)
        return x

    @triton.jit
    def _taps(wgt, offs, W: tl.constexpr):
        """The 4 conv taps of the channels offs; wgt points at this head's [D, W] taps."""
        return (tl.load(wgt + offs * W).to(tl.float32), tl.load(wgt + offs * W + 1).to(tl.float32),
                tl.load(wgt + offs * W + 2).to(tl.float32), tl.load(wgt + offs * W + 3).to(tl.float32))

    @triton.jit
    def _history(new, rep, hist, conv_ch, conv_tap, r, b, h, L, R, offs, H: tl.constexpr, D: tl.constexpr,
                 W: tl.constexpr):
        """The pooled conv history: inputs at t = -3, -2, -1."""
        return (_raw_input(new, rep, hist, conv_ch, conv_tap, -3, r, b, h, L, R, offs, H, D, W),
                _raw_input(new, rep, hist, conv_ch, conv_tap, -2, r, b, h, L, R, offs, H, D, W),
                _raw_input(new, rep, hist, conv_ch, conv_tap, -1, r, b, h, L, R, offs, H, D, W))

    @triton.jit
    def _conv_silu(x3, x2, x1, x, w0, w1, w2, w3):
        """Swish(ShortConv): inputs at t-3, t-2, t-1, t times the taps, summed in that order."""
        acc = x3 * w0 + x2 * w1 + x1 * w2 + x * w3
        return acc * tl.sigmoid(acc)

    @triton.jit
    def _new_conv_window(new, rep, hist, conv_ch, conv_tap, end, r, b, h, L, R, offs, H: tl.constexpr,
                         D: tl.constexpr, W: tl.constexpr, BWM: tl.constexpr, N: tl.constexpr):
        """The last W-1 inputs before virtual position `end` of the N channels `offs`, as [N, BWM]."""
        cols = tl.arange(0, BWM)
        block = tl.zeros([N, BWM], dtype=tl.float32)
        for j in tl.static_range(W - 1):
            x = _raw_input(new, rep, hist, conv_ch, conv_tap, end - (W - 1) + j, r, b, h, L, R, offs, H, D, W)
            block = tl.where(cols[None, :] == j, x[:, None], block)
        return block

    @triton.jit
    def _write_conv_window(new, rep, hist, conv_ch, conv_tap, end, r, b, h, L, R, offs, H: tl.constexpr,
                           D: tl.constexpr, W: tl.constexpr, BWM: tl.constexpr, N: tl.constexpr, lim):
        """Store the new conv window of the channels offs < lim (lim = 0: store nothing)."""
        block = _new_conv_window(new, rep, hist, conv_ch, conv_tap, end, r, b, h, L, R, offs, H, D, W, BWM, N)
        cols = tl.arange(0, BWM)
        ptrs = hist + offs[:, None] * conv_ch + cols[None, :] * conv_tap
        tl.store(ptrs, block.to(hist.dtype.element_ty), mask=(offs[:, None] < lim) & (cols[None, :] < W - 1))

    @triton.jit
    def _gated_norm_store(o, gate, out, tok, offs, norm_weight, norm_eps, lim, D: tl.constexpr):
        """y = RMSNorm(o) * w * sigmoid(gate) for one token of one head, stored where offs < lim."""
        g = tl.load(gate + tok + offs, mask=offs < lim, other=0.0).to(tl.float32)
        y = rms_normalized(o, D, norm_eps) * norm_weight * tl.sigmoid(g)
        tl.store(out + tok + offs, y.to(out.dtype.element_ty), mask=offs < lim)

    @triton.jit
    def _norm_parked_rows(o_scratch, gate, out, norm_w, norm_eps, b, h, L, offs, lim, H: tl.constexpr,
                          D: tl.constexpr):
        """The gated RMSNorm of all L rows of one head from the o slices its programs parked (lim = D in
        the last program to arrive, 0 elsewhere: masks, not a branch, so all programs run the same code)."""
        weight = tl.load(norm_w + offs).to(tl.float32)
        for j in range(0, L):
            row = ((b * L + j) * H + h) * D
            # .cg: read the siblings' writes from L2, never a stale L1 line.
            o = tl.load(o_scratch + row + offs, mask=offs < lim, other=0.0, cache_modifier=".cg")
            _gated_norm_store(o, gate, out, row, offs, weight, norm_eps, lim, D)

    @triton.jit
    def _kda_fused_recurrent_kernel(
        q, k, v, z, beta, gate,
        rq, rk, rv, rz, rbeta, n_replay,
        conv_w, A_log, dt_bias, norm_w,
        state, conv_state, slots, out, snapshots, o_scratch, counters,
        L, R, n_commit, state_slot, state_head, state_row, state_col,
        conv_slot, conv_stream, conv_head, conv_ch, conv_tap,
        scale, lower_bound, l2_eps, norm_eps,
        H: tl.constexpr, D: tl.constexpr, W: tl.constexpr, BWM: tl.constexpr, BV: tl.constexpr,
        BOUNDED: tl.constexpr, HAS_REPLAY: tl.constexpr, SNAPSHOT: tl.constexpr, REGISTER_WINDOW: tl.constexpr,
    ):
        """Grid (B, H, D // BV): program (b, h, j) owns value columns j*BV.. of head h's state.

        With BV < D the value columns of one head are split over D // BV programs (more programs in
        flight, fewer registers each); the output RMSNorm needs the whole row, so each program parks its
        o slice in o_scratch and the last one to finish (an atomic counter per (b, h)) normalises the
        rows and writes the q/k conv windows, which every sibling reads until it is done.
        """
        b = tl.program_id(0).to(tl.int64)
        h = tl.program_id(1).to(tl.int64)
        NV: tl.constexpr = D // BV
        offs = tl.arange(0, D)
        offs_v = tl.program_id(2) * BV + tl.arange(0, BV)
        slot = tl.load(slots + b).to(tl.int64)
        r = b * 0  # a tensor, so that masks built from it are tensors under the interpreter too
        if HAS_REPLAY:
            r = tl.load(n_replay + b).to(tl.int64)
        s_offs = offs[:, None] * D + offs_v[None, :]  # dense [D, D] index: snapshots, store masks
        s_ptrs = (state + slot * state_slot + h * state_head
                  + offs[:, None] * state_row + offs_v[None, :] * state_col)
        S = tl.load(s_ptrs)
        hist = conv_state + slot * conv_slot + h * conv_head
        stream = conv_stream
        taps = conv_w + h * D * W
        a_scale = tl.exp(tl.load(A_log + h).to(tl.float32))
        g_bias = tl.load(dt_bias + h * D + offs).to(tl.float32)
        norm_weight = tl.load(norm_w + offs_v).to(tl.float32)
        commit = r + n_commit
        tl.static_assert(W == 4, "the register conv window assumes 4 taps (K3 / Kimi Linear)")
        hk, hv = hist + stream, hist + 2 * stream
        # The conv window lives in registers (x[t-3], x[t-2], x[t-1] per stream): one input load per
        # token and stream instead of W, so a token step waits on a single round of loads.
        q3, q2, q1 = _history(q, rq, hist, conv_ch, conv_tap, r, b, h, L, R, offs, H, D, W)
        k3, k2, k1 = _history(k, rk, hk, conv_ch, conv_tap, r, b, h, L, R, offs, H, D, W)
        v3, v2, v1 = _history(v, rv, hv, conv_ch, conv_tap, r, b, h, L, R, offs_v, H, D, W)
        for t in range(0, r + L):
            # Taps are re-read each token (L1 hits) rather than held live across the loop.
            qw0, qw1, qw2, qw3 = _taps(taps, offs, W)
            kw0, kw1, kw2, kw3 = _taps(taps + H * D * W, offs, W)
            vw0, vw1, vw2, vw3 = _taps(taps + 2 * H * D * W, offs_v, W)
            if not REGISTER_WINDOW:  # one token: re-reading the history costs nothing, and frees registers
                q3, q2, q1 = _history(q, rq, hist, conv_ch, conv_tap, r, b, h, L, R, offs, H, D, W)
                k3, k2, k1 = _history(k, rk, hk, conv_ch, conv_tap, r, b, h, L, R, offs, H, D, W)
                v3, v2, v1 = _history(v, rv, hv, conv_ch, conv_tap, r, b, h, L, R, offs_v, H, D, W)
            xq = _raw_input(q, rq, hist, conv_ch, conv_tap, t, r, b, h, L, R, offs, H, D, W)
            xk = _raw_input(k, rk, hk, conv_ch, conv_tap, t, r, b, h, L, R, offs, H, D, W)
            xv = _raw_input(v, rv, hv, conv_ch, conv_tap, t, r, b, h, L, R, offs_v, H, D, W)
            qt = _conv_silu(q3, q2, q1, xq, qw0, qw1, qw2, qw3)
            kt = _conv_silu(k3, k2, k1, xk, kw0, kw1, kw2, kw3)
            vt = _conv_silu(v3, v2, v1, xv, vw0, vw1, vw2, vw3)
            q3, q2, q1 = q2, q1, xq
            k3, k2, k1 = k2, k1, xk
            v3, v2, v1 = v2, v1, xv
            qt = qt * tl.rsqrt(tl.sum(qt * qt, 0) + l2_eps)
            kt = kt * tl.rsqrt(tl.sum(kt * kt, 0) + l2_eps)
            zt = _raw_input(z, rz, hist, conv_ch, conv_tap, t, r, b, h, L, R, offs, H, D, W) + g_bias
            if BOUNDED:
                gt = lower_bound * tl.sigmoid(a_scale * zt)
            else:  # Kimi Linear: -exp(A) softplus(z), torch's threshold of 20 kept
                gt = -a_scale * tl.where(zt > 20.0, zt, tl.log(1.0 + tl.exp(zt)))
            bt = tl.load(rbeta + (b * R + t) * H + h, mask=t < r, other=0.0).to(tl.float32)
            bt += tl.load(beta + (b * L + (t - r)) * H + h, mask=t >= r, other=0.0).to(tl.float32)
            bt = tl.sigmoid(bt)
            S = S * tl.exp(gt)[:, None]
            u = bt * (vt - tl.sum(S * kt[:, None], 0))
            S = S + kt[:, None] * u[None, :]
            o = tl.sum(S * (qt * scale)[:, None], 0)
            new_lim = tl.where(t >= r, D, 0)
            tok = ((b * L + (t - r)) * H + h) * D
            if NV == 1:
                _gated_norm_store(o, gate, out, tok, offs_v, norm_weight, norm_eps, new_lim, D)
            else:
                tl.store(o_scratch + tok + offs_v, o, mask=offs_v < new_lim)
            if SNAPSHOT:
                tl.store(snapshots + tok * D + s_offs, S, mask=s_offs < new_lim * D)
            tl.store(s_ptrs, S, mask=s_offs < tl.where(t == commit - 1, D * D, 0))
        # The conv windows after the committed tokens. Each program owns its v channels.
        _write_conv_window(v, rv, hv, conv_ch, conv_tap, commit, r, b, h, L, R, offs_v, H, D, W, BWM, BV, D)
        lim = D  # channels this program writes below: all of them unless it is not the last sibling
        if NV > 1:
            # acq_rel: the siblings' o slices (and their reads of the q/k history) happen before.
            arrived = tl.atomic_add(counters + b * H + h, 1)
            lim = tl.where(arrived == NV - 1, D, 0)
        _write_conv_window(q, rq, hist, conv_ch, conv_tap, commit, r, b, h, L, R, offs, H, D, W, BWM, D, lim)
        _write_conv_window(k, rk, hk, conv_ch, conv_tap, commit, r, b, h, L, R, offs, H, D, W, BWM, D, lim)
        if NV > 1:
            _norm_parked_rows(o_scratch, gate, out, norm_w, norm_eps, b, h, L, offs, lim, H, D)
            tl.atomic_xchg(counters + b * H + h, 0, mask=lim > 0)  # ready for the next launch


_COUNTERS: dict[torch.device, torch.Tensor] = {}


def _zeroed_counters(n: int, device: torch.device) -> torch.Tensor:
    """Per-(sequence, head) arrival counters; every launch leaves them at zero again, so they are reused."""
    buf = _COUNTERS.get(device)
    if buf is None or buf.numel() < n:
        buf = _COUNTERS[device] = torch.zeros(max(n, 1024), dtype=torch.int32, device=device)
    return buf


def _check_pool(state_pool: torch.Tensor, conv_pool: torch.Tensor, slots: torch.Tensor, heads: int,
                dim: int) -> int:
    require(state_pool.dtype == torch.float32, f"state_pool must be float32, got {state_pool.dtype}")
    require(state_pool.dim() == 4 and tuple(state_pool.shape[1:]) == (heads, dim, dim),
            f"state_pool must be [num_slots, {heads}, {dim}, {dim}], got {tuple(state_pool.shape)}")
    require(conv_pool.dim() == 5 and tuple(conv_pool.shape[1:4]) == (3, heads, dim),
            f"conv_pool must be [num_slots, 3, {heads}, {dim}, W-1], got {tuple(conv_pool.shape)}")
    require(slots.dim() == 1 and not slots.dtype.is_floating_point, "slots must be a 1-D integer tensor")
    return conv_pool.shape[-1] + 1


def _check_tokens(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, z: torch.Tensor, beta: torch.Tensor,
                  gate: torch.Tensor, conv_weight: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor,
                  norm_weight: torch.Tensor, state_pool: torch.Tensor, conv_pool: torch.Tensor,
                  slots: torch.Tensor) -> int:
    """Validate [B, L, H, D] token inputs and the pools; returns the conv width W."""
    B, L, H, D = q.shape
    for name, t in (("k", k), ("v", v), ("z", z), ("gate", gate)):
        require(t.shape == q.shape, f"{name} must be {tuple(q.shape)} like q, got {tuple(t.shape)}")
    require(beta.shape == (B, L, H), f"beta must be [{B}, {L}, {H}], got {tuple(beta.shape)}")
    require(D == next_pow2(D), f"head dim must be a power of two, got {D}")
    W = _check_pool(state_pool, conv_pool, slots, H, D)
    require(W == 4, f"conv_pool must hold W-1 = 3 history columns (4-tap ShortConv), got {W - 1}")
    require(slots.shape[0] == B, f"slots must have {B} entries, got {slots.shape[0]}")
    require(conv_weight.shape == (3, H * D, W), f"conv_weight must be [3, {H * D}, {W}], got "
            f"{tuple(conv_weight.shape)}")
    require(A_log.shape == (H,), f"A_log must be [{H}], got {tuple(A_log.shape)}")
    require(dt_bias.numel() == H * D, f"dt_bias must hold H*K={H * D} values, got {dt_bias.numel()}")
    require(norm_weight.shape == (D,), f"norm_weight must be [{D}], got {tuple(norm_weight.shape)}")
    return W


def fused_kda_recurrent(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, z: torch.Tensor, beta: torch.Tensor,
    gate: torch.Tensor, conv_weight: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor,
    norm_weight: torch.Tensor, state_pool: torch.Tensor, conv_pool: torch.Tensor, slots: torch.Tensor,
    replay: tuple[torch.Tensor, ...] | None = None, n_commit: int | None = None,
    lower_bound: float | None = -5.0, scale: float | None = None, l2_eps: float = 1e-6,
    norm_eps: float = 1e-6, snapshots: torch.Tensor | None = None, num_warps: int = 4,
    block_v: int | None = None,
) -> torch.Tensor:
    """Run L new tokens per sequence ([B, L, H, D] inputs) on the pooled states of `slots` [B].

    replay: optional (q, k, v, z, beta, n_replay) of cached draft inputs [B, R, ...] with n_replay [B]
    tokens to replay first (no output). The state after replay + n_commit new tokens (default all L) is
    written to the pool, as is the conv window there (the pools may be any strided views, see the module
    docstring); snapshots [B, L, H, D, D] (optional) receives the
    state after every new token (the one-state-per-draft baseline). block_v < D splits each head's value
    columns over D // block_v programs. Returns y [B, L, H, D] in q's dtype.
    """
    B, L, H, D = q.shape
    W = _check_tokens(q, k, v, z, beta, gate, conv_weight, A_log, dt_bias, norm_weight, state_pool, conv_pool,
                      slots)
    q, k, v, z, beta, gate = (t.contiguous() for t in (q, k, v, z, beta, gate))  # no-ops when they are
    n_commit = L if n_commit is None else n_commit
    require(0 <= n_commit <= L, f"n_commit must be in [0, {L}], got {n_commit}")
    if replay is None:
        rq, rk, rv, rz, rbeta, n_replay = q, k, v, z, beta, slots
        R = 0
    else:
        rq, rk, rv, rz, rbeta, n_replay = replay
        R = rq.shape[1]
        require(rq.shape == (B, R, H, D) and rbeta.shape == (B, R, H), "replay inputs must be [B, R, H, D]")
        require(n_replay.shape == (B,), f"n_replay must be [{B}], got {tuple(n_replay.shape)}")
    if snapshots is not None:
        require(snapshots.shape == (B, L, H, D, D) and snapshots.dtype == torch.float32,
                f"snapshots must be float32 [{B}, {L}, {H}, {D}, {D}]")
    block_v = block_v or D
    require(D % block_v == 0 and block_v == next_pow2(block_v), f"block_v must divide {D}, got {block_v}")
    out = torch.empty_like(q)
    split = block_v < D
    o_scratch = torch.empty(q.shape, dtype=torch.float32, device=q.device) if split else out
    counters = _zeroed_counters(B * H, q.device) if split else slots
    _kda_fused_recurrent_kernel[(B, H, D // block_v)](
        q, k, v, z, beta, gate,
        rq.contiguous(), rk.contiguous(), rv.contiguous(), rz.contiguous(), rbeta.contiguous(), n_replay,
        conv_weight.contiguous(), A_log, dt_bias.contiguous(), norm_weight,
        state_pool, conv_pool, slots, out, snapshots if snapshots is not None else out, o_scratch, counters,
        L, R, n_commit, *state_pool.stride(), *conv_pool.stride(),
        D**-0.5 if scale is None else scale, -5.0 if lower_bound is None else lower_bound, l2_eps, norm_eps,
        H=H, D=D, W=W, BWM=next_pow2(W - 1), BV=block_v,
        BOUNDED=lower_bound is not None, HAS_REPLAY=replay is not None, SNAPSHOT=snapshots is not None,
        REGISTER_WINDOW=replay is not None or L > 1,
        num_warps=num_warps,
    )
    return out
