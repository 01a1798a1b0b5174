"""Kimi Delta Attention, plain-torch reference math (K3 report §2.1.1, eq.1-5).

Layout follows fla: q, k, g [B, T, H, K]; v [B, T, H, V]; beta [B, T, H]; state [N, H, K, V]; packed
variable-length batches through `cu_seqlens` [N+1] with B == 1.

Convention (eq.1, the state is key-dim x value-dim):
    S_t = (I - beta_t k_t k_t^T) Diag(exp(g_t)) S_{t-1} + beta_t k_t v_t^T
    o_t = scale * S_t^T q_t
g is the natural-log per-key-channel decay (alpha_t = exp(g_t)); the output reads the state AFTER the
token's own update. q and k are expected L2-normalised by the caller (eq.2); scale defaults to K**-0.5.
Everything accumulates in float32 at least (float64 inputs stay float64); outputs come back in v's dtype,
states in the accumulation dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from k3core.ops._common import acc_dtype, check_initial_state, sequence_bounds, start_state
from k3core.ops.kda_chunk import kda_chunk
from k3core.ops.short_conv import causal_short_conv, short_conv_step

__all__ = [
    "causal_short_conv",
    "kda_chunk",
    "kda_gate_bounded",
    "kda_gate_softplus",
    "kda_recurrent",
    "kda_step",
    "l2norm",
    "short_conv_step",
]


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(sum(x^2) + eps) over the last dim (fla's convention), in x's dtype."""
    dtype = acc_dtype(x)
    xf = x.to(dtype)
    return (xf * torch.rsqrt(xf.square().sum(-1, keepdim=True) + eps)).to(x.dtype)


def _gate_input(z: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor | None) -> tuple:
    dtype = acc_dtype(z)
    heads, key_dim = z.shape[-2], z.shape[-1]
    if A_log.shape != (heads,):
        raise ValueError(f"A_log must be [H]={heads}, got {tuple(A_log.shape)}")
    zf = z.to(dtype)
    if dt_bias is not None:
        zf = zf + dt_bias.to(dtype).reshape(heads, key_dim)
    return zf, A_log.to(dtype).exp().unsqueeze(-1)  # scale [H, 1]


def kda_gate_bounded(
    z: torch.Tensor, A_log: torch.Tensor, lower_bound: float = -5.0, dt_bias: torch.Tensor | None = None
) -> torch.Tensor:
    """K3 eq.5: g = lower_bound * sigmoid(exp(A_log) * (z + dt_bias)), in (lower_bound, 0).

    z: [..., H, K] decay logits (W_up W_down x); dt_bias: [H*K] or [H, K] (b_alpha of eq.2).
    """
    if lower_bound >= 0:
        raise ValueError(f"lower_bound must be negative, got {lower_bound}")
    zf, scale = _gate_input(z, A_log, dt_bias)
    return lower_bound * torch.sigmoid(scale * zf)


def kda_gate_softplus(
    z: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor | None = None
) -> torch.Tensor:
    """Kimi Linear: g = -exp(A_log) * softplus(z + dt_bias), in (-inf, 0)."""
    zf, scale = _gate_input(z, A_log, dt_bias)
    return -scale * F.softplus(zf)


def _delta_update(
    state: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor
) -> torch.Tensor:
    """One token of eq.1 for [..., K, V] states: decay, then the delta-rule write."""
    decayed = state * g.exp().unsqueeze(-1)
    residual = v - torch.einsum("...kv,...k->...v", decayed, k)
    return decayed + beta[..., None, None] * k.unsqueeze(-1) * residual.unsqueeze(-2)


def kda_step(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    scale: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One decode token: q, k, g [B, H, K], v [B, H, V], beta [B, H], state [B, H, K, V].

    Returns (o [B, H, V] in v's dtype, new_state in the accumulation dtype).
    """
    dtype = acc_dtype(q, k, v, g, state)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    new_state = _delta_update(state.to(dtype), k.to(dtype), v.to(dtype), g.to(dtype), beta.to(dtype))
    o = torch.einsum("bhkv,bhk->bhv", new_state, q.to(dtype) * scale)
    return o.to(v.dtype), new_state


def kda_recurrent(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | None = None,
    output_final_state: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Token-by-token eq.1: the ground truth every other KDA path is checked against.

    Returns (o [B, T, H, V], final_state [N, H, K, V] or None).
    """
    batch, length, heads, key_dim = q.shape
    seqs = sequence_bounds(cu_seqlens, batch, length)
    check_initial_state(initial_state, len(seqs), "initial_state")
    dtype = acc_dtype(q, k, v, g)
    o = torch.empty_like(v)
    finals = []
    for n, (row, start, end) in enumerate(seqs):
        state = start_state(initial_state, n, (heads, key_dim, v.shape[-1]), dtype, q)
        for t in range(start, end):
            o_t, state = kda_step(
                q[row, t : t + 1],
                k[row, t : t + 1],
                v[row, t : t + 1],
                g[row, t : t + 1],
                beta[row, t : t + 1],
                state.unsqueeze(0),
                scale,
            )
            o[row, t] = o_t[0]
            state = state[0]
        finals.append(state)
    return o, (torch.stack(finals) if output_final_state else None)
