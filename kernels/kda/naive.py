"""Plain-torch references for the KDA kernels: the CPU path and the oracle of every KDA Triton kernel.

Each function has the exact interface of its Triton peer and is composed from k3core.ops (short conv,
L2Norm, gate, delta rule, gated RMSNorm); nothing of the math is restated here. Everything runs in
float32 (the kernels keep every intermediate on chip in float32), outputs come back in q's dtype.
The pools may be strided views (e.g. of head-interleaved pool pages): states are read and written by
indexing them, so every write lands in the viewed storage (tests/kernels/test_kda_strided.py).
"""

from __future__ import annotations

import torch

from k3core.ops.kda import (
    causal_short_conv,
    kda_chunk,
    kda_gate_bounded,
    kda_gate_softplus,
    kda_step,
    l2norm,
    short_conv_step,
)
from k3core.ops.norm import gated_rms_norm

F32 = torch.float32


def _gate(z: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor, lower_bound: float | None) -> torch.Tensor:
    if lower_bound is None:
        return kda_gate_softplus(z.to(F32), A_log, dt_bias)
    return kda_gate_bounded(z.to(F32), A_log, lower_bound, dt_bias)


def _token(
    x: tuple[torch.Tensor, ...], conv: torch.Tensor, state: torch.Tensor, conv_weight: torch.Tensor,
    A_log: torch.Tensor, dt_bias: torch.Tensor, norm_weight: torch.Tensor, lower_bound: float | None,
    scale: float | None, l2_eps: float, norm_eps: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One token of one sequence: x = (q, k, v, z, beta, gate) [H, D] ([H] for beta); conv [3, H, D, W-1].

    Returns (y [H, D] float32, new conv [3, H, D, W-1], new state [H, D, D]).
    """
    q, k, v, z, beta, gate = x
    heads, dim = q.shape
    streams, windows = [], []
    for c, raw in enumerate((q, k, v)):
        y, window = short_conv_step(raw.reshape(1, -1).to(F32), conv[c].reshape(1, heads * dim, -1).to(F32),
                                    conv_weight[c].to(F32))
        streams.append(y.reshape(1, heads, dim))
        windows.append(window.reshape(heads, dim, -1))
    qc, kc, vc = streams
    g = _gate(z, A_log, dt_bias, lower_bound).reshape(1, heads, dim)
    o, new_state = kda_step(l2norm(qc, l2_eps), l2norm(kc, l2_eps), vc, g, torch.sigmoid(beta.to(F32))[None],
                            state[None].to(F32), scale)
    y = gated_rms_norm(o, gate[None].to(F32), norm_weight, norm_eps)
    return y[0], torch.stack(windows), new_state[0]


def fused_kda_recurrent(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, z: torch.Tensor, beta: torch.Tensor,
    gate: torch.Tensor, conv_weight: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor,
    norm_weight: torch.Tensor, state_pool: torch.Tensor, conv_pool: torch.Tensor, slots: torch.Tensor,
    replay: tuple[torch.Tensor, ...] | None = None, n_commit: int | None = None,
    lower_bound: float | None = -5.0, scale: float | None = None, l2_eps: float = 1e-6,
    norm_eps: float = 1e-6, snapshots: torch.Tensor | None = None, num_warps: int = 4,
    block_v: int | None = None,
) -> torch.Tensor:
    """Reference of kernels.kda.decode_triton.fused_kda_recurrent (same contract; tuning ignored)."""
    del num_warps, block_v
    B, L = q.shape[:2]
    n_commit = L if n_commit is None else n_commit
    out = torch.empty_like(q)
    params = (conv_weight, A_log, dt_bias, norm_weight, lower_bound, scale, l2_eps, norm_eps)
    for b in range(B):
        slot = int(slots[b])
        conv, state = conv_pool[slot].to(F32), state_pool[slot].to(F32)
        tokens = [tuple(t[b, i] for t in (q, k, v, z, beta, gate)) for i in range(L)]
        n_rep = 0
        if replay is not None:
            n_rep = int(replay[5][b])
            # Replayed tokens produce no output, so their gate is never read.
            tokens = [tuple(t[b, i] for t in replay[:5]) + (q[b, 0],) for i in range(n_rep)] + tokens
        for i, x in enumerate(tokens):
            y, conv, state = _token(x, conv, state, *params)
            if i >= n_rep:
                out[b, i - n_rep] = y.to(out.dtype)
                if snapshots is not None:
                    snapshots[b, i - n_rep] = state
            if i == n_rep + n_commit - 1:
                state_pool[slot] = state
                conv_pool[slot] = conv.to(conv_pool.dtype)
    return out


def kda_decode_step(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, z: torch.Tensor, beta: torch.Tensor,
    gate: torch.Tensor, conv_weight: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor,
    norm_weight: torch.Tensor, state_pool: torch.Tensor, conv_pool: torch.Tensor, slots: torch.Tensor,
    lower_bound: float | None = -5.0, scale: float | None = None, l2_eps: float = 1e-6,
    norm_eps: float = 1e-6, num_warps: int = 4, block_v: int | None = None,
) -> torch.Tensor:
    """Reference of kernels.kda.decode_step_triton.kda_decode_step."""
    y = fused_kda_recurrent(
        *(t.unsqueeze(1) for t in (q, k, v, z, beta, gate)), conv_weight, A_log, dt_bias, norm_weight,
        state_pool, conv_pool, slots, lower_bound=lower_bound, scale=scale, l2_eps=l2_eps, norm_eps=norm_eps,
    )
    return y.squeeze(1)


def kda_prefill_block(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, z: torch.Tensor, beta: torch.Tensor,
    gate: torch.Tensor, conv_weight: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor,
    norm_weight: torch.Tensor, initial_state: torch.Tensor | None = None,
    initial_conv: torch.Tensor | None = None, cu_seqlens: torch.Tensor | None = None,
    lower_bound: float | None = -5.0, scale: float | None = None, l2_eps: float = 1e-6,
    norm_eps: float = 1e-6,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The KDA block from projections to the gated, normalised output (before W_o).

    q, k, v, z, gate [B, T, H, D]; beta [B, T, H]; conv_weight [3, H*D, W]; initial_state [N, H, D, D];
    initial_conv [N, 3, H, D, W-1]. Returns (y [B, T, H, D], final_state [N, H, D, D] float32,
    final_conv [N, 3, H, D, W-1] in q's dtype).
    """
    B, T, H, D = q.shape
    streams, finals = [], []
    for c, raw in enumerate((q, k, v)):
        init = None if initial_conv is None else initial_conv[:, c].reshape(-1, H * D, initial_conv.shape[-1])
        y, final = causal_short_conv(raw.reshape(B, T, H * D).to(F32), conv_weight[c].to(F32),
                                     initial_state=None if init is None else init.to(F32), cu_seqlens=cu_seqlens)
        streams.append(y.reshape(B, T, H, D))
        finals.append(final.reshape(-1, H, D, final.shape[-1]))
    qc, kc, vc = streams
    o, state = kda_chunk(l2norm(qc, l2_eps), l2norm(kc, l2_eps), vc, _gate(z, A_log, dt_bias, lower_bound),
                         torch.sigmoid(beta.to(F32)), scale=scale, initial_state=initial_state,
                         cu_seqlens=cu_seqlens)
    y = gated_rms_norm(o, gate.to(F32), norm_weight, norm_eps)
    return y.to(q.dtype), state, torch.stack(finals, dim=1).to(q.dtype)
